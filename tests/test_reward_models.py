"""RewardModel: a tiny sequence-classification model scores prompt + completion with its own tokenizer."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from grpo_hf.rewards import compute_rewards, reward_func_name
from grpo_hf.rewards.reward_models import RewardModel, load_reward_model

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def build_tokenizer(chat_template=TEMPLATE, pad=True) -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte, with a BOS token prepended when add_special_tokens=True."""
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if pad else None,
        chat_template=chat_template,
    )


def build_model(vocab_size: int, pad_token_id: int | None = 0, seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=pad_token_id,
        initializer_range=0.2,
    )
    return LlamaForSequenceClassification(config).eval()


@torch.no_grad()
def manual_score(model, ids: list[int]) -> float:
    return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


PROMPTS = ["Q: 2+2? A:", "Q: capital of France? A:", "Q: 3*3? A:"]
COMPLETIONS = [" 4", " Paris, of course, it is Paris.", " 9"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(len(tok))


def test_scores_equal_manual_forward(model, tok):
    rm = RewardModel(model, tok, batch_size=2)  # 3 texts of different lengths: 2 batches, right padding
    scores = rm(PROMPTS, COMPLETIONS, completion_ids=[[1]] * 3, answer=["x"] * 3)
    expected = [manual_score(model, tok(p + c)["input_ids"]) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert tok(PROMPTS[0])["input_ids"][0] == tok.bos_token_id
    assert scores == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert len(set(round(s, 6) for s in scores)) == 3  # each completion gets its own score
    assert max(scores) - min(scores) > 1e-3
    assert all(type(s) is float for s in scores)


def test_each_completion_scored_independently_of_batch(model, tok):
    rm = RewardModel(model, tok, batch_size=8)
    together = rm(PROMPTS, COMPLETIONS)
    alone = [rm([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert together == pytest.approx(alone, rel=1e-4, abs=1e-6)
    assert rm([PROMPTS[0]], [" 5"]) != pytest.approx(rm([PROMPTS[0]], [" 4"]))


def test_conversational_uses_reward_chat_template(model, tok):
    rm = RewardModel(model, tok)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    scores = rm(prompts, completions)
    expected = []
    for p, c in zip(prompts, completions, strict=True):
        text = tok.apply_chat_template(p + c, tokenize=False)
        assert text.startswith("[user] Q:") and "[assistant]" in text
        expected.append(manual_score(model, tok(text, add_special_tokens=False)["input_ids"]))
    assert scores == pytest.approx(expected, rel=1e-4, abs=1e-6)
    texts, special = rm.texts(prompts[:1], completions[:1])
    assert texts == [f"[user] {PROMPTS[0]}\n[assistant] {COMPLETIONS[0]}\n"] and special == [False]


def test_conversational_without_template_concatenates(model):
    tok = build_tokenizer(chat_template=None)
    rm = RewardModel(model, tok)
    prompts = [[{"role": "user", "content": PROMPTS[0]}]]
    completions = [[{"role": "assistant", "content": COMPLETIONS[0]}]]
    assert rm.texts(prompts, completions) == ([PROMPTS[0] + COMPLETIONS[0]], [True])
    assert rm(prompts, completions) == pytest.approx(rm(PROMPTS[:1], COMPLETIONS[:1]))


def test_from_path_and_name(model, tok, tmp_path):
    path = tmp_path / "tiny-rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    rm = load_reward_model(str(path))
    assert rm.__name__ == "tiny-rm" and reward_func_name(rm) == "tiny-rm"
    assert not rm.model.training
    assert rm(PROMPTS, COMPLETIONS) == pytest.approx(RewardModel(model, tok)(PROMPTS, COMPLETIONS), rel=1e-4, abs=1e-6)
    # Through the trainer's calling machinery, next to a plain function.
    rewards, errors = compute_rewards([rm], PROMPTS, COMPLETIONS)
    assert [row[0] for row in rewards] == pytest.approx(rm(PROMPTS, COMPLETIONS)) and errors == {"tiny-rm": 0}


def test_missing_pad_token_is_set():
    tok = build_tokenizer(pad=False)
    model = build_model(len(tok), pad_token_id=None)
    rm = RewardModel(model, tok, batch_size=4)
    assert tok.pad_token == "</s>" and model.config.pad_token_id == tok.eos_token_id
    scores = rm(PROMPTS, COMPLETIONS)
    expected = [manual_score(model, tok(p + c)["input_ids"]) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert scores == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert reward_func_name(rm) == "LlamaForSequenceClassification"


def test_max_length_keeps_last_tokens(model, tok):
    rm = RewardModel(model, tok, max_length=6)
    ids = tok(PROMPTS[1] + COMPLETIONS[1])["input_ids"]
    assert rm(PROMPTS[1:2], COMPLETIONS[1:2]) == pytest.approx([manual_score(model, ids[-6:])], rel=1e-4, abs=1e-6)


def test_argument_checks(model, tok):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        RewardModel(object(), tok)
    with pytest.raises(ValueError, match="batch_size"):
        RewardModel(model, tok, batch_size=0)
    with pytest.raises(ValueError, match="reward_processing_classes"):
        RewardModel(model)  # built in memory: no path to load a tokenizer from
