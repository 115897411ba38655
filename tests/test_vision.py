"""Vision-language models (docs/vision.md): TRL's `image`/`images` columns, each row with its own images through
micro-batching, image tokens never sampled, image features computed once per prompt, LoRA on the language model,
`log_multimodal`. Tiny Qwen2-VL models built from configs (`tests/tiny_vlm.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trl
from conftest import tiny_run_args, torchrun
from datasets import Dataset
from tiny_vlm import image, tiny_gemma3, tiny_idefics3, tiny_qwen2_vl

from grpo_hf import GRPOTrainer
from grpo_hf.rollout import RolloutEngine, Sequences, make_engine, register_engine
from grpo_hf.rollout.tools import tool_reply_ids
from grpo_hf.rollout.vision import tokenize_vision_prompts, tool_reply_inputs, with_images
from grpo_hf.vision import (
    FEATURES,
    LANGUAGE_MODELS,
    encode_rows,
    forward_kwargs,
    image_token_ids,
    token_type_kwargs,
    vision_modules,
)

torch.set_num_threads(1)


# Three families: Qwen2-VL (patches split by `image_grid_thw`, M-RoPE), Gemma 3 (one `pixel_values` entry per image,
# bidirectional attention over an image's tokens by `token_type_ids`) and Idefics3 / SmolVLM (images cut into tiles,
# `pixel_values` [1, tiles, C, H, W] per prompt, zero-padded across prompts).
FAMILIES = {"qwen2_vl": tiny_qwen2_vl, "gemma3": tiny_gemma3, "idefics3": tiny_idefics3}


LANGUAGE = tuple(f"model.{name}." for name in LANGUAGE_MODELS)  # parameter names of the language model


def freeze_vision(model, frozen: bool = True) -> None:
    for module in vision_modules(model).values():
        module.requires_grad_(not frozen)


def token_reward(completions, completion_ids, **kwargs):
    """Differs from completion to completion (the completions of 4 tokens all have the same length)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def row_images(k: int) -> list:
    """Row k's images: sizes differ from row to row (other patch grids), row 1 has two, row 3 none (text-only)."""
    if k % 4 == 3:
        return []
    first = image(k, 56 + 28 * (k % 2), 56)
    return [first, image(100 + k, 84, 56)] if k % 4 == 1 else [first]


def dataset(kind: str, n: int = 4) -> Dataset:
    """n rows in one of TRL's formats: 'strings' (chat messages with string contents, images placed by the trainer),
    'parts' (content parts with an image part per image), 'plain' (plain-string prompts)."""
    rows = []
    for k in range(n):
        images = row_images(k)
        if kind == "parts":
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"row {k}: what is it?"}]
            prompt = [{"role": "user", "content": parts}]
        elif kind == "plain":  # the model's own image markers, written by the user (one image: put in front)
            marks = "<|vision_start|><|image_pad|><|vision_end|>" * len(images) if len(images) > 1 else ""
            prompt = f"{marks}row {k}: what is it?"
        else:
            prompt = [{"role": "user", "content": f"row {k}: what is it?"}]
        rows.append({"prompt": prompt, "images": images})
    return Dataset.from_list(rows)


def trainer_for(
    tmp_path, data, model=None, processor=None, family="qwen2_vl", eval_dataset=None, **overrides
) -> GRPOTrainer:
    if model is None:
        model, processor = FAMILIES[family]()
    args = tiny_run_args(tmp_path, **overrides)
    return GRPOTrainer(
        model=model,
        reward_funcs=token_reward,
        args=args,
        train_dataset=data,
        eval_dataset=eval_dataset,
        processing_class=processor,
    )


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("qwen2_vl", "strings"),
        ("qwen2_vl", "parts"),
        ("qwen2_vl", "plain"),
        ("gemma3", "parts"),
        ("idefics3", "parts"),
    ],
)
def test_trains_on_rows_with_one_several_and_no_images(tmp_path, family, kind):
    trainer = trainer_for(
        tmp_path, dataset(kind), family=family, beta=0.1, steps_per_generation=2, max_steps=2, learning_rate=1e-2
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert any(name.startswith(LANGUAGE) for name in changed)
    tower = [f"model.{name}." for name in vision_modules(trainer.model)]
    assert any(name.startswith(prefix) for name in changed for prefix in tower)  # full fine-tuning: as TRL


def test_the_image_column_holds_one_image(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"row {k}"}], "image": image(k)} for k in range(2)]
    trainer = trainer_for(tmp_path, Dataset.from_list(rows))
    trainer.train()
    assert trainer.state.global_step == 1


def plain_logps(model, processor, prompt, images, completion_ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [t] of `completion_ids` [t] after `prompt` with its own `images`: the processor's own encoding and one
    forward of this row alone, nothing of grpo_hf."""
    text = processor.apply_chat_template(with_images(prompt, images, "<|image_pad|>"), add_generation_prompt=True)
    encoded = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    input_ids = torch.cat([encoded["input_ids"], completion_ids[None]], dim=1)
    kwargs = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
    for key in ("mm_token_type_ids", "token_type_ids"):  # per token: text (0) on the completion
        if key in kwargs:
            kwargs[key] = torch.cat([kwargs[key], kwargs[key].new_zeros(1, completion_ids.numel())], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, **kwargs).logits[0, -completion_ids.numel() - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, completion_ids[:, None])[:, 0]


@pytest.mark.kernel_paths
@pytest.mark.parametrize(
    ("family", "G", "batch_size", "frozen"),
    [
        ("qwen2_vl", 4, 2, True),
        ("qwen2_vl", 2, 4, True),
        ("qwen2_vl", 2, 4, False),
        ("gemma3", 2, 4, True),
        ("idefics3", 2, 4, False),
    ],
)
def test_each_row_keeps_its_own_images_in_every_micro_batch(tmp_path, family, G, batch_size, frozen):
    """A row's reference log-probs from the trainer's micro-batches equal a plain forward of that row alone with its
    own images: with a group split over two micro-batches, and with two groups of other images in one; with image
    features cached (frozen tower) or not. Rows whose images differ in number and size make any mis-split show."""
    data = dataset("parts", n=16 // G)
    steps = 16 // batch_size  # one generation batch of 16 rows
    trainer = trainer_for(
        tmp_path,
        data,
        family=family,
        beta=0.1,
        num_generations=G,
        per_device_train_batch_size=batch_size,
        steps_per_generation=steps,
    )
    reference = trainer.ref_model
    freeze_vision(trainer.model, frozen)  # cached features must still be each row's own
    rows = [data[k] for k in range(16 // G) for _ in range(G)]
    batches = trainer.experience.train_batches(rows)
    assert len(batches) == steps and trainer.experience.num_image_encodings == (3 * 4 // G if frozen else 0)
    checked = 0
    tokenizer = processor_tokenizer(trainer)
    for batch in batches:
        for i in range(len(batch)):
            prompt = tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()])
            k = int(prompt.split("row ")[1].split(":")[0])
            completion = batch.completion_ids[i][batch.completion_mask[i].bool()]
            expected = plain_logps(reference, trainer.processing_class, data[k]["prompt"], row_images(k), completion)
            actual = batch.ref_logps[i][: completion.numel()]
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
            checked += 1
    assert checked == 16


def processor_tokenizer(trainer):
    return trainer.processing_class.tokenizer


def test_a_mis_split_is_caught():
    """The check above can fail: a row given another row's images has other log-probs."""
    model, processor = tiny_qwen2_vl()
    prompt = [{"role": "user", "content": "row 0: what is it?"}]
    completion = torch.tensor([100, 101, 102])
    own = plain_logps(model, processor, prompt, [image(0)], completion)
    other = plain_logps(model, processor, prompt, [image(2)], completion)
    assert (own - other).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tiny_model_sees_its_images(family):
    """A row's log-probs depend on its image's pixels and the whole vision side gets a gradient: else the tests of
    which row gets which image, and of the tower's gradient, would pass whatever the trainer did with the images
    (transformers initialises Gemma 3's projector to zeros: `tiny_vlm.tiny_gemma3`)."""
    model, processor = FAMILIES[family]()
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    completion = torch.tensor([20, 30, 40, 50])
    first, second = (plain_logps(model, processor, prompt, [image(k)], completion) for k in (0, 1))
    assert (first - second).abs().max() > 1e-3
    text = processor.apply_chat_template(with_images(prompt, [image(0)], "<|image_pad|>"), add_generation_prompt=True)
    encoded = processor(text=[text], images=[[image(0)]], return_tensors="pt")
    model(**encoded).logits[0, -1].logsumexp(-1).backward()
    for name, module in vision_modules(model).items():
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in module.parameters()), name


def vision_batch(processor, n_prompts: int = 3, G: int = 2):
    prompts = [[{"role": "user", "content": f"row {k}"}] for k in range(n_prompts) for _ in range(G)]
    images = [row_images(k) for k in range(n_prompts) for _ in range(G)]
    return tokenize_vision_prompts(processor, prompts, images)


def test_rows_of_a_group_share_one_encoding_and_text_rows_have_none():
    _, processor = tiny_qwen2_vl()
    prompt_ids, prompt_mask, truncated, rows = vision_batch(processor, n_prompts=4)
    assert rows[0] is rows[1] and rows[2] is rows[3] and rows[0] is not rows[2]
    assert rows[6] is None and rows[7] is None  # row 3: no image
    assert rows[2]["image_grid_thw"].shape == (2, 3)  # row 1: two images, each its own grid
    assert not truncated.any() and prompt_ids.shape == prompt_mask.shape


def test_token_types_read_off_the_ids_match_the_processor():
    model, processor = tiny_qwen2_vl()
    text = processor.apply_chat_template(
        with_images([{"role": "user", "content": "hi"}], [image(0)], ""), tokenize=False
    )
    encoded = processor(text=[text], images=[[image(0)]], return_tensors="pt")
    derived = token_type_kwargs(model, encoded["input_ids"])
    assert torch.equal(derived["mm_token_type_ids"], encoded["mm_token_type_ids"].int())


@pytest.mark.parametrize(("family", "engine_name"), [(f, e) for f in FAMILIES for e in ("loop", "generate")])
def test_image_tokens_are_never_sampled(family, engine_name):
    """The model is made to prefer image tokens by far; the engine never draws them (without the block it does)."""
    model, processor = FAMILIES[family]()
    blocked = image_token_ids(model)
    placeholder = {"qwen2_vl": "<|image_pad|>", "gemma3": "<image_soft_token>", "idefics3": "<image>"}[family]
    assert processor.tokenizer.convert_tokens_to_ids(placeholder) in blocked
    assert len(blocked) == {"qwen2_vl": 4, "gemma3": 3, "idefics3": 1}[family]  # placeholders, start and end markers
    boost = torch.zeros(model.config.text_config.vocab_size)
    boost[blocked] = 50.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + boost)
    prompt_ids, prompt_mask, _, rows = vision_batch(processor)
    config = model.generation_config
    config.update(do_sample=True, max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    sampled = {}
    for block in (blocked, []):
        engine, _ = make_engine(engine_name, model, config, [processor.tokenizer.eos_token_id])
        engine.blocked_token_ids = list(block)
        torch.manual_seed(0)
        completions = engine.generate(model, prompt_ids, prompt_mask, images=rows)
        sampled[bool(block)] = completions.completion_ids[completions.completion_mask.bool()]
    assert not torch.isin(sampled[True], torch.tensor(blocked)).any()
    assert torch.isin(sampled[False], torch.tensor(blocked)).float().mean() > 0.9


class _TurnsSource:
    """`loop.decode_turns`' source for text-only rows: each context's turn, handed out once, recorded when it ends."""

    def __init__(self, contexts: list[list[int]], budget: int):
        self.ready = [(k, context, budget) for k, context in enumerate(contexts)]
        self.turns: dict[int, list[int]] = {}

    def poll(self, block):
        ready, self.ready = self.ready, []
        return ready

    def turn_done(self, key, turn, logps):
        self.turns[key] = list(turn)


def test_tool_episode_turns_never_sample_image_tokens():
    """`decode_turns` (the loop engine's tool-episode decoder) on a VLM's text-only rows, the image tokens preferred by
    far: the engine's blocked tokens are never drawn (without the block they nearly always are)."""
    model, processor = tiny_qwen2_vl()
    blocked = image_token_ids(model)
    boost = torch.zeros(model.config.text_config.vocab_size)
    boost[blocked] = 50.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + boost)
    tokenizer = processor.tokenizer
    contexts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("row 0: hi", "row one, longer")]
    config = model.generation_config
    config.update(do_sample=True, max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    sampled = {}
    for block in (True, False):
        engine, _ = make_engine(
            "loop", model, config, [tokenizer.eos_token_id], blocked_token_ids=blocked if block else ()
        )
        source = _TurnsSource(contexts, budget=6)
        torch.manual_seed(0)
        engine.decode_turns(model, source)
        sampled[block] = torch.tensor([token for turn in source.turns.values() for token in turn])
    assert len(sampled[True]) > 0 and not torch.isin(sampled[True], torch.tensor(blocked)).any()
    assert torch.isin(sampled[False], torch.tensor(blocked)).float().mean() > 0.9


def test_engines_without_images_are_skipped():
    model, processor = tiny_qwen2_vl()
    config = model.generation_config
    config.update(do_sample=True, max_new_tokens=4)
    engine, why = make_engine("auto", model, config, [2], blocked_token_ids=image_token_ids(model))
    assert engine.takes_images and engine.blocked_token_ids == image_token_ids(model)
    register_engine("text_only", TextOnlyEngine)
    with pytest.raises(ValueError, match="does not take images"):
        make_engine("text_only", model, config, [2], blocked_token_ids=image_token_ids(model))
    assert make_engine("text_only", model, config, [2])[0].name == "text_only"  # a text-only model is fine


class TextOnlyEngine(RolloutEngine):
    name = "text_only"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engines_sample_what_generate_samples_for_each_prompt_alone(family):
    """The loop (each prompt prefilled once, M-RoPE positions shifted by its images) and the generate engine, on a
    batch of prompts with other images, left-padded: top_k=1 gives the tokens `model.generate` gives each prompt
    alone, from the processor's own encoding."""
    model, processor = FAMILIES[family](seed=3)
    prompt_ids, prompt_mask, _, rows = vision_batch(processor, n_prompts=4, G=1)
    config = model.generation_config
    config.update(do_sample=True, max_new_tokens=8, top_k=1)
    alone = []
    for k in range(4):
        prompt = with_images([{"role": "user", "content": f"row {k}"}], row_images(k), "")
        text = processor.apply_chat_template(prompt, add_generation_prompt=True)
        encoded = processor(text=[text], images=[row_images(k)] if row_images(k) else None, return_tensors="pt")
        output = model.generate(**encoded, generation_config=config)[0, encoded["input_ids"].size(1) :]
        alone.append(output)
    for name in ("loop", "generate"):
        engine, _ = make_engine(name, model, config, [processor.tokenizer.eos_token_id])
        completions = engine.generate(model, prompt_ids, prompt_mask, images=rows)
        for k in range(4):
            n = int(completions.completion_mask[k].sum())
            assert torch.equal(completions.completion_ids[k, :n], alone[k][:n]), (name, k)


@pytest.mark.kernel_paths
def test_cached_features_give_the_plain_log_probs():
    """Log-probs with each prompt's image features computed once (frozen tower) equal those with the pixels."""
    from grpo_hf.logprobs import padded_logps

    model, processor = tiny_qwen2_vl()
    model.eval()
    prompt_ids, prompt_mask, _, rows = vision_batch(processor, n_prompts=4)
    completion_ids = torch.randint(10, 200, (len(rows), 5), generator=torch.Generator().manual_seed(0))
    batch = Sequences(prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), image_inputs=rows)
    with torch.no_grad():
        plain, _ = padded_logps(model, batch)
        assert encode_rows(model, rows) == 0  # the tower trains: nothing is cached
        freeze_vision(model)
        assert encode_rows(model, rows) == 3  # three prompts with images (the fourth is text-only)
        assert "pixel_values" not in forward_kwargs(model, prompt_ids, rows)
        cached, _ = padded_logps(model, batch)
    assert FEATURES in rows[0]
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-6)


def test_the_vision_encoder_runs_once_per_prompt_per_generation_batch(tmp_path):
    """Frozen tower, beta > 0, old log-probs (an optimizer step inside the generation batch), steps_per_generation=2:
    one tower call for the rollout's prefill (all prompts at once) and one per prompt for every log-prob forward
    after it; none in the old, reference or policy forwards themselves."""
    model, processor = tiny_qwen2_vl()
    model.model.visual.requires_grad_(False)
    calls = []
    model.model.visual.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    data = dataset("strings", n=4)  # rows 0-2 with images (row 1: two), row 3 text-only
    trainer = trainer_for(tmp_path, data, model, processor, beta=0.1, steps_per_generation=2, max_steps=2)
    trainer.train()
    assert trainer.experience.needs_old_logps and trainer.state.global_step == 2 and trainer.num_generate_calls == 1
    assert len(calls) == 1 + 3  # the prefill + one per prompt with images
    assert trainer.experience.num_image_encodings == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_the_language_model_and_leaves_the_tower_frozen(tmp_path, family):
    """Qwen2-VL's tower names its attention `qkv`, Gemma 3's SigLIP `q_proj` / `v_proj`, like the language model's:
    the adapters still go on the language model only."""
    from peft import LoraConfig

    model, processor = FAMILIES[family]()
    data = dataset("strings", n=3)  # every row with images
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"], lora_dropout=0.0)
    args = tiny_run_args(tmp_path, beta=0.1, learning_rate=1e-2, max_steps=1)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=token_reward,
        args=args,
        train_dataset=data,
        processing_class=processor,
        peft_config=peft_config,
    )
    lora = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert lora and all(
        "lora_" in name and name.startswith(tuple(f"base_model.model.{m}" for m in LANGUAGE)) for name in lora
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.experience.num_image_encodings == 2  # the tower is frozen: each prompt's features cached


def test_a_model_path_loads_as_an_image_text_to_text_model(tmp_path):
    model, processor = tiny_qwen2_vl()
    model.save_pretrained(tmp_path / "model")
    trainer = trainer_for(tmp_path, dataset("strings", n=2), model=str(tmp_path / "model"), processor=processor)
    assert type(trainer.model).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.parametrize("log_multimodal", [True, False])
def test_log_multimodal_keeps_the_images_with_the_completions(tmp_path, log_multimodal):
    data = dataset("strings", n=2)
    trainer = trainer_for(tmp_path, data, log_completions=True, log_multimodal=log_multimodal)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    if not log_multimodal:
        assert all("images" not in row for row in rows)
        return
    assert [len(row["images"]) for row in rows] == [1, 1, 2, 2]
    assert all((tmp_path / path).is_file() for row in rows for path in row["images"])


def test_image_columns_need_a_processor(tmp_path):
    model, processor = tiny_qwen2_vl()
    with pytest.raises(ValueError, match="processing_class is a tokenizer, not a processor"):
        trainer_for(tmp_path, dataset("strings", n=2), model, processor.tokenizer)


def test_a_row_needs_as_many_image_places_as_images():
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "two?"}]}]
    with pytest.raises(ValueError, match="1 image place"):
        with_images(prompt, [image(0), image(1)], "<|image_pad|>")
    assert with_images("hi", [image(0)], "<|image_pad|>") == "<|image_pad|>hi"
    with pytest.raises(ValueError, match="0 image place"):
        with_images("hi", [image(0), image(1)], "<|image_pad|>")


def test_a_prompt_with_images_is_not_truncated_into_its_image_tokens():
    _, processor = tiny_qwen2_vl()
    with pytest.raises(ValueError, match="left-truncating it would cut image tokens"):
        tokenize_vision_prompts(processor, [[{"role": "user", "content": "hi"}]], [[image(0)]], max_prompt_length=5)


def test_the_loop_numbers_decoding_positions_as_the_model_numbers_the_whole_sequence():
    """M-RoPE: an image takes fewer positions than tokens, so decoding continues from the prompt's last position, not
    its token count. The loop's logits for a completion's second token equal those of one forward over the prompt
    and its first token, numbered by the model itself."""
    model, processor = tiny_qwen2_vl(seed=3)
    prompt_ids, prompt_mask, _, rows = vision_batch(processor, n_prompts=3, G=2)
    config = model.generation_config
    config.update(do_sample=True, max_new_tokens=2, top_k=1)
    decoded = []
    model.lm_head.register_forward_hook(lambda module, args, output: decoded.append(output[:, -1].detach()))
    engine, _ = make_engine("loop", model, config, [processor.tokenizer.eos_token_id])
    completions = engine.generate(model, prompt_ids, prompt_mask, images=rows).completion_ids
    step_logits = decoded[1]  # [N, V]: the decoding step after the prefill
    decoded.clear()
    ids = torch.cat([prompt_ids, completions[:, :1]], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completions[:, :1])], dim=1)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **forward_kwargs(model, ids, rows))
    torch.testing.assert_close(step_logits, decoded[0], rtol=0, atol=1e-5)


def _vlm_step(tmp_path, num_processes: int) -> dict:
    out = tmp_path / f"vlm_step_{num_processes}.pt"
    torchrun("vlm_step.py", out, processes=num_processes, timeout=300)
    return torch.load(out)


def test_two_processes_match_one_process(tmp_path):
    """DDP over 2 gloo processes, each with its own prompt's group and images (one and two images of other sizes):
    the same advantages, loss and clipped update as 1 process."""
    one, two = _vlm_step(tmp_path, 1), _vlm_step(tmp_path, 2)
    assert one["advantages"].abs().sum() > 0
    torch.testing.assert_close(two["advantages"], one["advantages"], rtol=0, atol=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, value in one["params"].items():
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.kernel_paths
@pytest.mark.parametrize(("family", "frozen"), [(f, frozen) for f in FAMILIES for frozen in (False, True)])
def test_the_shared_prompt_prefix_gives_the_padded_log_probs_and_gradients(family, frozen):
    """Each prompt run once with its images (or their cached features), its completions on its KV cache at positions
    after its images' (M-RoPE): the log-probs and the gradients (the tower's too, when it trains) of one padded forward
    over every row."""
    from grpo_hf.logprobs import padded_logps, shared_prefix_logps, supports_shared_prefix

    model, processor = FAMILIES[family]()
    freeze_vision(model, frozen)
    assert supports_shared_prefix(model)
    prompt_ids, prompt_mask, _, rows = vision_batch(processor, n_prompts=4)
    completion_ids = torch.randint(10, 200, (len(rows), 5), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0
    batch = Sequences(prompt_ids, prompt_mask, completion_ids, completion_mask, image_inputs=rows)
    if frozen:
        assert encode_rows(model, rows) == 3
    results = []
    for logps_of in (padded_logps, shared_prefix_logps):
        model.zero_grad()
        logps, _ = logps_of(model, batch)
        (logps * completion_mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach() * completion_mask, grads))
    (padded, padded_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    assert padded_grads.keys() == shared_grads.keys()
    assert any(name.startswith(LANGUAGE) for name in padded_grads)
    assert frozen != any(not name.startswith((*LANGUAGE, "lm_head")) for name in padded_grads)
    # The two paths sum the same terms in other orders (each prompt once against G times, kernels chosen by shape and
    # by ATen's CPU kernel set); an fp32 entry that is a cancelling sum is off by ~1e-7 of its terms, not of itself.
    # With image tokens embedded like text (`tiny_gemma3`) the worst entry here uses under half this tolerance under
    # ATEN_CPU_CAPABILITY default, avx2 and avx512; with Gemma 3's zero projector its gradient reached 4e4 and one
    # entry of -14.8 was off by 3e-3 (issue 44).
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_evaluation_samples_and_scores_rows_with_images(tmp_path):
    data = dataset("parts", n=4)
    trainer = trainer_for(tmp_path, data, eval_dataset=data, per_device_eval_batch_size=4, beta=0.1)
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_loss" in metrics


def test_buffered_micro_batches_with_images_survive_a_checkpoint(tmp_path):
    """The run state keeps the buffered micro-batches as plain dicts (`torch.load(weights_only=True)`): their image
    inputs and cached features load back, a group's rows still sharing one dict."""
    from grpo_hf.rollout import MicroBatch

    data = dataset("parts", n=2)
    trainer = trainer_for(tmp_path, data, beta=0.1)
    freeze_vision(trainer.model)
    batches = trainer.experience.train_batches([data[k] for k in range(2) for _ in range(2)])
    torch.save([vars(batch) for batch in batches], tmp_path / "state.pt")
    (loaded,) = [MicroBatch(**part) for part in torch.load(tmp_path / "state.pt", weights_only=True)]
    rows = loaded.image_inputs
    assert rows[0] is rows[1] and rows[2] is rows[3] and FEATURES in rows[0]
    logps = trainer.logps.no_grad(trainer.model, loaded)
    torch.testing.assert_close(logps, trainer.logps.no_grad(trainer.model, batches[0]), rtol=0, atol=0)


# ---- tool episodes: a tool's reply with images --------------------------------------------------------------------
QWEN3_VL_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen3_vl.jinja").read_text()  # renders tools
QWEN2_5_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()  # no images there


def look(index: int) -> list | str:
    """Look at a picture: picture 0 is an image, the others are missing.

    Args:
        index: Which picture.
    """
    if index == 0:
        return [{"type": "image", "image": image(40, 56, 84)}, {"type": "text", "text": "picture 0"}]
    return f"no picture {index}"


def _tool_vlm_trainer(tmp_path, engine: str) -> GRPOTrainer:
    """A tiny Qwen2-VL with a chat template that renders tools and images in tool replies, the `look` tool, and
    text-only prompts; each first turn is read as a call of `look` with the prompt's row (row 0 gets a picture, row 1
    text), each later one as a plain answer. Its EOS is favoured (turns of a few tokens)."""
    model, processor = tiny_qwen2_vl(seed=2)
    processor.chat_template = processor.tokenizer.chat_template = QWEN3_VL_TEMPLATE
    eos = processor.tokenizer.eos_token_id
    boost = torch.zeros(model.config.text_config.vocab_size)
    boost[eos] = 6.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + boost)
    rows = [{"prompt": [{"role": "user", "content": f"row {k}: look at picture {k}"}]} for k in range(2)]
    args = tiny_run_args(
        tmp_path, rollout_engine=engine, max_completion_length=96, max_prompt_length=None, temperature=1.0, beta=0.0
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=token_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
        tools=[look],
    )

    def parse(tokenizer, ids, context, tools):
        text = tokenizer.decode(context)
        if "<tool_response>" in text:
            return {"role": "assistant", "content": "x"}
        function = {"name": "look", "arguments": {"index": 0 if "row 0:" in text else 1}}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}

    trainer.experience.sampler.episodes.parse = parse
    return trainer


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_a_tools_images_are_read_by_the_next_turn_and_the_training_forward(tmp_path, engine):
    """A tool answers one prompt's episodes with a picture and the other's with text: the picture's replies hold its
    image tokens (the processor's), the engine call that samples their next turn gets the picture's inputs (with the
    `loop` engine, after the text episodes' turns have been decoded as they come), and the training forward's
    log-probs of every row equal those of one plain forward over the row's ids with its picture, if it has one."""
    trainer = _tool_vlm_trainer(tmp_path, engine)
    model, processor = trainer.model, trainer.processing_class
    calls = []
    original = trainer.experience.sampler.engine_for

    def recording(model):
        engine = original(model)
        if not hasattr(engine, "_recorded"):
            generate, engine._recorded = engine.generate, True

            def generate_recording(model, ids, mask, **kwargs):
                calls.append((ids.clone(), kwargs.get("images")))
                return generate(model, ids, mask, **kwargs)

            engine.generate = generate_recording
        return engine

    trainer.experience.sampler.engine_for = recording
    torch.manual_seed(0)
    rows = [row for row in trainer.train_dataset for _ in range(2)]
    (batch,) = trainer.experience.train_batches(rows)

    picture = processor.image_processor(images=[image(40, 56, 84)], return_tensors="pt")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tokens = int(picture["image_grid_thw"].prod()) // 4  # 2x2 patches merged into one token
    assert batch.image_inputs is not None and len(batch.image_inputs) == 4
    assert batch.image_inputs[2] is None and batch.image_inputs[3] is None  # row 1's episodes: no picture
    for row in range(4):
        assert int((batch.completion_ids[row] == pad).sum()) == (tokens if row < 2 else 0)  # the picture's place
        assert not batch.completion_mask[row][batch.completion_ids[row] == pad].any()  # read, not trained
        if row < 2:
            torch.testing.assert_close(batch.image_inputs[row]["pixel_values"], picture["pixel_values"])
            torch.testing.assert_close(batch.image_inputs[row]["image_grid_thw"], picture["image_grid_thw"])
    after_picture = [(ids[k], images[k]) for ids, images in calls if images is not None for k in range(len(ids))]
    assert len(after_picture) >= 2  # the second turns of row 0's episodes (with `generate`, beside row 1's)
    for ids, images in after_picture:
        has_picture = bool((ids == pad).any())
        assert has_picture == (images is not None)
        if has_picture:
            assert int((ids == pad).sum()) == tokens
            torch.testing.assert_close(images["pixel_values"], picture["pixel_values"])
    assert sum(bool((ids == pad).any()) for ids, _ in after_picture) == 2
    assert engine != "loop" or (len(calls) == 1 and len(after_picture) == 2)  # the text episodes: decode_turns alone

    logps = trainer.logps.no_grad(model, batch)  # the training path's log-probs
    for row in range(4):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        n = int(batch.attention_mask[row].sum())
        input_ids = torch.cat([prompt, batch.completion_ids[row, :n]])[None]
        kwargs = {**picture, "mm_token_type_ids": (input_ids == pad).int()} if row < 2 else {}
        with torch.no_grad():
            logits = model(input_ids=input_ids, **kwargs).logits[0, prompt.numel() - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, input_ids[0, prompt.numel() :, None])[:, 0]
        sampled = batch.completion_mask[row, :n].bool()
        torch.testing.assert_close(logps[row, :n][sampled], expected[sampled], rtol=0, atol=1e-5)


def test_a_template_that_cannot_place_a_tools_image_is_an_error():
    """TRL's Qwen2.5 template renders tools but not images in tool messages: a reply with an image is refused,
    naming the problem, rather than leaving the image out of what the model reads."""
    _, processor = tiny_qwen2_vl()
    processor.chat_template = processor.tokenizer.chat_template = QWEN2_5_TEMPLATE
    reply = {"role": "tool", "name": "look", "content": look(0)}
    with pytest.raises(ValueError, match=r"A tool replied with 1 image\(s\), which the processor could not place"):
        tool_reply_inputs(processor, [reply], {})
    text = [{"role": "tool", "name": "look", "content": look(1)}]  # a reply without images: the tokenizer's ids
    assert tool_reply_inputs(processor, text, {}) == (tool_reply_ids(processor.tokenizer, text, {}), None)
