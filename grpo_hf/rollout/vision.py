"""Prompts with images: TRL's dataset format for vision-language models, tokenized by the model's processor, each
prompt with its own images (docs/vision.md).

A row carries its images in an `image` column (one) or an `images` column (a list; empty or None for a text-only
row), beside its `prompt`:

- a conversational prompt whose contents are strings gets one `{"type": "image"}` part per image before the text
  of its first user message (TRL's `prepare_multimodal_messages`); contents that are already lists of parts
  (`{"type": "image"}`, `{"type": "text", "text": ...}`) are kept, and their image parts take the row's images in
  order;
- a plain-string prompt holds the processor's image token (`processor.image_token`) once per image, written as the
  model's chat format writes it (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`); with one image and no
  token, the token is put in front. (TRL refuses plain-string prompts with images.)

`tokenize_vision_prompts` renders and tokenizes each distinct prompt (a group's G copies together) once, with its
own images, and returns, beside the ids, one `vision.ImageRow` per row: that prompt's image inputs (shared by its
G rows), or None for a text-only row.

A tool may answer with content parts holding images (`[{"type": "image", "image": PIL image}, {"type": "text",
...}]`, as TRL's tools do): `tool_reply_inputs` renders such a reply with the processor, which puts the model's image
tokens in the places the chat template gives the images, and returns the reply's image inputs beside its ids. A chat
template that renders no place for a reply's image (one that renders only text in tool messages) is an error, on
every transformers version (`check_image_places`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo_hf.rollout.batching import pad_token_lists
from grpo_hf.rollout.prompts import fit_prompt, is_conversational
from grpo_hf.rollout.tools import tool_reply_ids
from grpo_hf.vision import PER_TOKEN_FIELDS, ImageRow, tokenizer_of

IMAGE_COLUMNS = ("image", "images")


def row_images(row: dict[str, Any]) -> list:
    """The images of a dataset row: its `images` list, or its single `image`; [] for none."""
    if row.get("images") is not None:
        return list(row["images"])
    if row.get("image") is not None:
        return [row["image"]]
    return []


def _as_parts(content: Any) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def with_images(prompt: Any, images: Sequence, image_token: str) -> Any:
    """`prompt` with a place for each of `images` (the module docstring says where); checked to have as many places
    as images."""
    if not is_conversational(prompt):
        if isinstance(prompt, str) and len(images) == 1 and image_token not in prompt:
            return image_token + prompt
        places = prompt.count(image_token) if isinstance(prompt, str) else 0
    else:
        messages, placed = [], False
        for message in prompt:
            content = message.get("content")
            if isinstance(content, str) and message["role"] == "user" and not placed and images:
                content, placed = [*({"type": "image"} for _ in images), {"type": "text", "text": content}], True
            messages.append({**message, "content": _as_parts(content) if content is not None else content})
        prompt = messages
        places = sum(
            part.get("type") == "image" for m in prompt if isinstance(m.get("content"), list) for part in m["content"]
        )
    if places != len(images):
        raise ValueError(
            f"A prompt has {places} image place(s) but its row has {len(images)} image(s) (columns 'image'/'images'). "
            "Give each image a {'type': 'image'} content part (or leave the contents as strings and let the trainer "
            "place them), or fix the row's images."
        )
    return prompt


def _render(processor, prompt: Any, chat_template_kwargs: dict) -> str:
    if is_conversational(prompt):
        return processor.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    return prompt


def _encode(processor, prompt: Any, images: list, chat_template_kwargs: dict) -> tuple[list[int], ImageRow | None]:
    """One prompt's token ids and image inputs (None without images), by the processor."""
    text = _render(
        processor, with_images(prompt, images, getattr(processor, "image_token", "<image>")), chat_template_kwargs
    )
    if not images:
        return tokenizer_of(processor)(text, add_special_tokens=False)["input_ids"], None
    encoded = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    ids = encoded["input_ids"][0].tolist()
    return ids, {k: v for k, v in encoded.items() if k not in PER_TOKEN_FIELDS and isinstance(v, torch.Tensor)}


def tokenize_vision_prompts(
    processor,
    prompts: Sequence[Any],
    images: Sequence[list],
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[ImageRow | None]]:
    """`rollout.tokenize_prompts` for prompts with images (`images[i]`: row i's, [] for none): prompt_ids and
    prompt_mask [N, P] (left-padded), is_prompt_truncated [N], and each row's image inputs. Each run of identical
    consecutive rows (a group) is encoded once and its rows share one `ImageRow`.

    A prompt with images longer than `max_prompt_length` is an error: left-truncation would cut image tokens from
    their features. A text-only prompt is fitted as `tokenize_prompts` does (`prompts.fit_prompt`).
    """
    tokenizer = tokenizer_of(processor)
    starts = [i for i in range(len(prompts)) if i == 0 or prompts[i] != prompts[i - 1] or images[i] != images[i - 1]]
    bounds = list(zip(starts, [*starts[1:], len(prompts)], strict=True))
    encoded, rows, truncated = [], [], []
    for start, stop in bounds:
        ids, row = _encode(processor, prompts[start], list(images[start]), chat_template_kwargs or {})
        too_long = max_prompt_length is not None and len(ids) > max_prompt_length
        if too_long and row is not None:
            raise ValueError(
                f"A prompt with images is {len(ids)} tokens long, over max_prompt_length={max_prompt_length}: "
                "left-truncating it would cut image tokens away from their features. Raise max_prompt_length (or set "
                "it to None), or use smaller images (the image processor's max_pixels)."
            )
        if too_long:  # text only: as `tokenize_prompts` (whole turns of history, or a plain prompt's beginning)
            encode = lambda p: _encode(processor, p, [], chat_template_kwargs or {})[0]  # noqa: E731
            ids = fit_prompt(prompts[start], ids, max_prompt_length, encode)
        encoded.append(ids)
        truncated += [too_long] * (stop - start)
        rows += [row] * (stop - start)
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("A prompt encodes to zero tokens; remove empty prompts from the dataset.")
    unique_ids, unique_mask = pad_token_lists(encoded, tokenizer.pad_token_id, left=True)  # [U, P] each
    repeats = torch.tensor([stop - start for start, stop in bounds])
    prompt_ids = unique_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = unique_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    return prompt_ids, prompt_mask, torch.tensor(truncated), rows


def check_image_places(processor, text: str, images: int) -> None:
    """A ValueError unless the rendered `text` holds the processor's image token (`processor.image_token`, where the
    processor expands an image into its tokens) once per image, as transformers >= 5.23's processors check themselves
    (`ProcessorMixin.validate_inputs`); before 5.23 a processor encodes the images whether or not the text has a
    place for them, and the model reads none of them. A processor without an image token is not checked."""
    token = getattr(processor, "image_token", None)
    if token is not None and text.count(token) != images:
        raise ValueError(f"The text holds {text.count(token)} {token} token(s) for {images} image(s).")


def reply_images(replies: Sequence[dict[str, Any]]) -> list:
    """The images in the content parts of tool messages `replies` (`{"type": "image", "image": ...}`), in order."""
    return [
        part["image"]
        for reply in replies
        if isinstance(reply.get("content"), list)
        for part in reply["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def tool_reply_inputs(
    processor, replies: list[dict[str, Any]], template_kwargs: dict[str, Any]
) -> tuple[list[int], ImageRow | None]:
    """`tools.tool_reply_ids` for a VLM, and the replies' image inputs (None when they hold no image): replies with
    images are rendered and tokenized by `processor` (its `apply_chat_template`), which expands each image's place to
    the model's image tokens for that image."""
    tokenizer = tokenizer_of(processor)
    if not reply_images(replies):
        return tool_reply_ids(tokenizer, replies, template_kwargs), None
    encoded = {}

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        images = reply_images(messages)
        if images:
            text = processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            check_image_places(processor, text, len(images))
        output = processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        encoded.update(output)  # the last call's: the stand-in conversation with the replies
        return output["input_ids"][0].tolist()

    try:
        ids = tool_reply_ids(tokenizer, replies, template_kwargs, render=render)
    except ValueError as error:
        raise ValueError(
            f"A tool replied with {len(reply_images(replies))} image(s), which the processor could not place in the "
            "tool message as the chat template renders it. Use a chat template that renders image parts in tool "
            f"messages (for example TRL's trl/chat_templates/qwen3_vl.jinja), or return text. The processor: {error}"
        ) from error
    return ids, {k: v for k, v in encoded.items() if k not in PER_TOKEN_FIELDS and isinstance(v, torch.Tensor)}
