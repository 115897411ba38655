"""Tiny vision-language models and their processors, built offline from configs (docs/vision.md).

The tokenizer is conftest's byte-level one with the model's image tokens added; the image processor is the PIL one
(torchvision is not needed), with its defaults shrunk so an image is a few patches. Qwen2-VL's processor also wants a
video processor, which needs torchvision: `_NoVideoQwen2VLProcessor` lets it be None.
"""

from __future__ import annotations

import torch
from conftest import build_tiny_tokenizer
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# ChatML with TRL's content parts: an image part is Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _NoVideoQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)


def tiny_qwen2_vl(seed: int = 0, hidden_size: int = 32, vision_depth: int = 1, vision_dim: int = 32):
    """(model, processor): a Qwen2-VL of ~0.1M parameters (2 text layers, M-RoPE; a 1-layer vision tower with its
    2x2 patch merger) and its processor; a 28x28-pixel cell is one image token, images are kept within 4-16 tokens."""
    tokenizer = build_tiny_tokenizer(QWEN_IMAGE_TOKENS, QWEN_TEMPLATE)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = _NoVideoQwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_TEMPLATE
    )
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_scaling={"type": "mrope", "mrope_section": mrope_section(hidden_size // 4)},
            **special_ids(tokenizer),
        ),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_dim,
            hidden_size=hidden_size,
            num_heads=2 if vision_dim <= 64 else 4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        **special_ids(tokenizer),
    )
    return seeded(Qwen2VLForConditionalGeneration, config, seed, tokenizer), processor


def special_ids(tokenizer) -> dict:
    """EOS and pad from the tokenizer, no BOS: for a config and its text config."""
    return dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


def seeded(model_class, config, seed: int, tokenizer):
    """`model_class(config)` initialised under `seed`, generating with the tokenizer's EOS and pad tokens."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.update(**special_ids(tokenizer))
    return model


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's split of a head's rotary frequencies (head_dim / 2) into temporal, height and width: Qwen2-VL's
    [16, 24, 24] of 64, scaled ([1, 1, 2] of 4)."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def image(seed: int, width: int = 56, height: int = 56) -> Image.Image:
    """A random RGB image (seeded), `width` x `height` pixels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


GEMMA_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# Gemma's turns with TRL's content parts: an image part is `<start_of_image>`, which the processor expands.
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tiny_gemma3(seed: int = 0, hidden_size: int = 32):
    """(model, processor): a Gemma 3 (2 text layers, full attention; a 1-layer SigLIP tower on 28x28 images, 2x2
    patches, 4 image tokens per image, one entry of `pixel_values` per image) and its processor. Its projector's
    weight is drawn, not zero, so the image tokens carry the image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    template = GEMMA_TEMPLATE.replace("<start_of_turn>", "<|im_start|>").replace("<end_of_turn>", "<|im_end|>")
    tokenizer = build_tiny_tokenizer(GEMMA_IMAGE_TOKENS, template)
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = GEMMA_IMAGE_TOKENS
    ids = tokenizer.convert_tokens_to_ids
    tokenizer.boi_token_id, tokenizer.eoi_token_id = ids("<start_of_image>"), ids("<end_of_image>")
    tokenizer.image_token_id = ids("<image_soft_token>")
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    processor.image_seq_length = 4
    processor.full_image_sequence = f"\n\n<start_of_image>{'<image_soft_token>' * 4}<end_of_image>\n\n"
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden_size // 4,
            query_pre_attn_scalar=hidden_size // 4,
            max_position_embeddings=1024,
            layer_types=["full_attention", "full_attention"],
            **special_ids(tokenizer),
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        **special_ids(tokenizer),
    )
    model = seeded(Gemma3ForConditionalGeneration, config, seed, tokenizer)
    # transformers initialises the projector's weight to zeros (a trained checkpoint's is not): every image token would
    # then embed to exactly 0, so images would not change the outputs nor the tower get a gradient, and the decoder's
    # first RMSNorm, whose gradient at 0 is 1 / sqrt(eps) = 1000, would blow the projector's gradient up to ~4e4 and
    # the fp32 rounding of its cancelling sums with it. Drawn like the other weights, image tokens embed like text.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(0.0, config.text_config.initializer_range, generator=generator)
    return model, processor


IDEFICS_IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
IDEFICS_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def tiny_idefics3(seed: int = 0, hidden_size: int = 32):
    """(model, processor): an Idefics3 (SmolVLM's architecture: a Llama of 2 layers, a 1-layer SigLIP-like tower on
    56x56 tiles, pixel shuffle by 2: 4 tokens per tile) and its processor, which tiles an image into up to 2x2 tiles
    plus a global view and pads `pixel_values` per row [1, tiles, 3, 56, 56]."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tiny_tokenizer(IDEFICS_IMAGE_TOKENS, IDEFICS_TEMPLATE)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    processor.chat_template = IDEFICS_TEMPLATE
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            **special_ids(tokenizer),
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        **special_ids(tokenizer),
    )
    return seeded(Idefics3ForConditionalGeneration, config, seed, tokenizer), processor
