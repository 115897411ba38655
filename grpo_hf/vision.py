"""Vision-language models (docs/vision.md): each row's images as model inputs, the vision arguments of a forward, the
image tokens no completion may contain, and image features computed once per prompt.

A leaf module (torch and transformers only), used by the rollout engines, the log-prob forwards and the experience
maker alike.

Each prompt's images go through the processor on their own (`rollout.vision`), so a row's image inputs are a dict of
its own tensors, never a slice of a batch: `pixel_values`, `image_grid_thw`, `image_sizes`, ... as the processor
returns them for that one prompt (`ImageRow`). The G rows of a group share one dict. A forward over some rows joins
their dicts in row order (`merge_rows`): concatenated along the first dimension, which is how every family the
processor flattens lays them out (Qwen2-VL's patches [sum of t*h*w, D] with one `image_grid_thw` row per image;
LLaVA's and Gemma 3's images [n_images, C, H, W]; Idefics3's and SmolVLM's one row per prompt [1, tiles, C, H, W],
zero-padded to the most tiles, as its processor pads a batch). The per-token fields (`mm_token_type_ids`,
`token_type_ids`) are not stored: they are read off the token ids of the rows being run (`token_type_kwargs`), so they
follow any padding, trimming or completion tokens.

With the vision side frozen (`vision_frozen`: the tower, and its projector, have no trainable parameter), the
features of a prompt's images are the same in every forward of a generation batch: `encode_rows` computes them once
per prompt, without gradient, and stores them in its dict (`FEATURES`); forwards then pass them as
`mm_encoder_outputs` instead of the pixels.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

ImageRow = dict[str, Any]  # one prompt's processor outputs (tensors) and, once encoded, its features (`FEATURES`)
FEATURES = "image_features"  # the key of an `ImageRow`'s cached features: the tower's output for its images
LANGUAGE_MODELS = ("language_model", "text_model")  # the multimodal base model's language model, by family
# Processor outputs that are per token, not per image: derived from the ids of each forward (`token_type_kwargs`).
PER_TOKEN_FIELDS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# Config attributes naming token ids that stand for an image inside a prompt; a completion never contains them.
_IMAGE_TOKEN_ATTRIBUTES = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "vision_start_token_id",
    "vision_end_token_id",
    "boi_token_id",
    "boi_token_index",
    "eoi_token_id",
    "eoi_token_index",
)


def is_processor(processing_class: Any) -> bool:
    """A multimodal processor (image processor + tokenizer), as opposed to a tokenizer."""
    return hasattr(processing_class, "image_processor") and hasattr(processing_class, "tokenizer")


def tokenizer_of(processing_class: Any) -> Any:
    """The tokenizer of `processing_class`: a processor's own tokenizer, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def _unwrap(model: nn.Module) -> nn.Module:
    """The bare transformers model under PEFT (`base_model.model`) and DDP-like (`module`) wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def is_vision_model(model: nn.Module) -> bool:
    """An image-text-to-text model: its config has a vision sub-config."""
    return getattr(getattr(_unwrap(model), "config", None), "vision_config", None) is not None


def image_token_ids(model: nn.Module) -> list[int]:
    """The ids of the tokens that stand for images in a prompt (placeholders, image start/end markers): a sampled one
    would not match the image features, so no completion may contain them. Empty for a text-only model."""
    if not is_vision_model(model):
        return []
    config = _unwrap(model).config
    ids = {getattr(config, name, None) for name in _IMAGE_TOKEN_ATTRIBUTES}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def multimodal_model(model: nn.Module) -> nn.Module:
    """The multimodal base model holding the language model (`language_model`; Idefics3's `text_model`) and the
    vision modules (`model.model` for most)."""
    bare = _unwrap(model)
    inner = getattr(bare, "model", bare)
    return inner if any(hasattr(inner, name) for name in LANGUAGE_MODELS) else bare


def vision_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that turn pixels into features, by name: every child of the multimodal base model but its language
    model (Qwen2-VL's `visual`; Gemma 3's `vision_tower` and `multi_modal_projector`; Idefics3's `vision_model` and
    `connector`)."""
    inner = multimodal_model(model)
    return {name: child for name, child in inner.named_children() if name not in LANGUAGE_MODELS}


def vision_frozen(model: nn.Module) -> bool:
    """Whether no parameter on the vision side trains (nor a PEFT adapter inside it): its features depend on the
    images only, so they can be computed once and reused."""
    return all(not p.requires_grad for module in vision_modules(model).values() for p in module.parameters())


def uses_mrope(model: nn.Module) -> bool:
    """Whether positions are 3-D (Qwen2-VL's M-RoPE): the model then numbers a prompt with images itself."""
    return hasattr(multimodal_model(model), "get_rope_index")


def position_offsets(model: nn.Module) -> Tensor | None:
    """[U, 1] for M-RoPE models after a prefill with images: how far each prompt's last position is from its token
    count (Qwen2-VL's `rope_deltas`); the decoding steps add it to the text positions. None for other models."""
    return getattr(multimodal_model(model), "rope_deltas", None) if uses_mrope(model) else None


def split_runs(runs: list[tuple[int, int]], rows: Sequence[ImageRow | None] | None) -> list[tuple[int, int]]:
    """Runs of identical prompt rows [start, stop) cut where the rows' image inputs differ: rows with the same tokens
    but other images are other prompts (a group's rows share one `ImageRow`)."""
    if rows is None:
        return runs
    cut = []
    for start, stop in runs:
        bounds = [start, *(i for i in range(start + 1, stop) if rows[i] is not rows[i - 1]), stop]
        cut += list(zip(bounds[:-1], bounds[1:], strict=True))
    return cut


def has_images(rows: Sequence[ImageRow | None] | None) -> bool:
    return rows is not None and any(row is not None for row in rows)


def merge_rows(rows: Sequence[ImageRow | None]) -> dict[str, Any]:
    """The image inputs of `rows` (text-only rows are None) in row order, as one forward takes them: each tensor
    concatenated along its first dimension; cached features (`FEATURES`) joined the same way."""
    present = [row for row in rows if row is not None]
    if not present:
        return {}
    merged = {}
    for key in present[0]:
        values = [row[key] for row in present]
        merged[key] = _join_features(values) if key == FEATURES else _padded_cat(values)
    return merged


def _padded_cat(values: list[Tensor]) -> Tensor:
    """`values` concatenated along dimension 0, each first padded with zeros at the end of every other dimension to
    the largest size: Idefics3 / SmolVLM give each prompt `pixel_values` [1, tiles, C, H, W] and a
    `pixel_attention_mask`, and take all-zero tiles as padding."""
    shape = [max(sizes) for sizes in zip(*(value.shape[1:] for value in values), strict=True)]
    padded = []
    for value in values:
        pad = [
            side
            for have, want in zip(reversed(value.shape[1:]), reversed(shape), strict=True)
            for side in (0, want - have)
        ]
        padded.append(torch.nn.functional.pad(value, pad) if any(pad) else value)
    return torch.cat(padded)


def _join_features(values: list) -> Any:
    """Per-prompt features joined as the model's `get_image_features` returns them for all: a tuple of per-image
    tensors (Qwen2-VL, LLaVA) or one tensor [n_images, ...] (Gemma 3)."""
    if isinstance(values[0], tuple | list):
        return tuple(feature for value in values for feature in value)
    return torch.cat(values)


def token_type_kwargs(model: nn.Module, input_ids: Tensor) -> dict[str, Tensor]:
    """The per-token modality fields the model's forward takes, read off `input_ids` [B, L]: `mm_token_type_ids`
    (0 text, 1 image, 2 video: Qwen2-VL) and `token_type_ids` (1 on image tokens: Gemma 3)."""
    bare = _unwrap(model)
    config, parameters = bare.config, inspect.signature(bare.forward).parameters
    image = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
    kwargs = {}
    if "mm_token_type_ids" in parameters:
        types = (input_ids == image).int()
        video = getattr(config, "video_token_id", None)
        if video is not None:
            types = types.masked_fill(input_ids == video, 2)
        kwargs["mm_token_type_ids"] = types
    if "token_type_ids" in parameters and image is not None:
        kwargs["token_type_ids"] = (input_ids == image).long()
    return kwargs


def forward_kwargs(model: nn.Module, input_ids: Tensor, rows: Sequence[ImageRow | None] | None) -> dict[str, Any]:
    """The vision arguments of a forward over `input_ids` [B, L] whose rows carry `rows` (None entries: text-only):
    the merged image inputs, or their cached features as `mm_encoder_outputs` in place of the pixels, and the
    per-token modality fields. Empty when no row has an image."""
    if not has_images(rows):
        return {}
    merged = merge_rows(rows)
    features = merged.pop(FEATURES, None)
    if features is not None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        merged.pop("pixel_values", None)
        merged["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=features)}
    return {**merged, **token_type_kwargs(model, input_ids)}


def image_features(model: nn.Module, row: ImageRow) -> Any:
    """The vision side's output for one prompt's images (`get_image_features`), without gradient: what the
    language model's image tokens are replaced by."""
    inner = multimodal_model(model)
    parameters = inspect.signature(inner.get_image_features).parameters
    accepted = {k: v for k, v in row.items() if k in parameters and k != FEATURES}
    with torch.no_grad():
        return inner.get_image_features(**accepted, return_dict=True).pooler_output


def encode_rows(model: nn.Module, rows: Sequence[ImageRow | None] | None) -> int:
    """Compute each distinct row dict's image features once (a group's G rows share one dict) and cache them in it
    (`FEATURES`), when the vision side is frozen; returns how many prompts were encoded. A dict that holds features
    already is left as it is. With a vision side that trains, nothing is cached: each forward encodes anew."""
    if not has_images(rows) or not vision_frozen(model):
        return 0
    encoded = 0
    seen: set[int] = set()
    for row in rows:
        if row is None or id(row) in seen or FEATURES in row:
            continue
        seen.add(id(row))
        row[FEATURES] = image_features(model, row)
        encoded += 1
    return encoded


def drop_features(rows: Sequence[ImageRow | None] | None) -> None:
    """Forget the cached features of `rows` (the next forwards encode their images again)."""
    for row in rows or ():
        if row is not None:
            row.pop(FEATURES, None)
