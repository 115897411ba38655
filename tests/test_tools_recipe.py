"""recipes/tools.py: the problems and their split, the warm-start traces, and a short run on a tiny model."""

import json
from pathlib import Path

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer, load_recipe
from transformers.utils import get_json_schema

from grpo_hf.rollout.tools import parse_turn, tool_chat_template

ROOT = Path(__file__).resolve().parents[1]


recipe = load_recipe("tools")
from tools_support.problems import correct_answer, make_problems, multiply, split_of  # noqa: E402
from tools_support.warm_start import trace_ids  # noqa: E402


def tool_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = recipe.QWEN_TEMPLATE.read_text()
    assert tool_chat_template(tokenizer) is None  # Qwen2.5's template is prefix-preserving; sets the response schema
    return tokenizer


def test_problems_are_seeded_and_the_splits_share_no_multiplication():
    train, test = make_problems(300, "train", seed=1), make_problems(60, "test", seed=1)
    assert make_problems(300, "train", seed=1)["question"] == train["question"]
    pairs = lambda ds: {(min(a, b), max(a, b)) for a, b in zip(ds["a"], ds["b"], strict=True)}  # noqa: E731
    assert not pairs(train) & pairs(test)
    assert all(split_of(a, b) == "test" and 11 <= a <= 99 for a, b in zip(test["a"], test["b"], strict=True))
    assert all(int(x) == a * b for x, a, b in zip(train["answer"], train["a"], train["b"], strict=True))
    assert get_json_schema(multiply)["function"]["parameters"]["required"] == ["a", "b"]


def test_the_reward_reads_the_models_last_message_only():
    call = {"role": "assistant", "content": "", "tool_calls": []}
    reply = {"role": "tool", "name": "multiply", "content": "1776"}
    episodes = [
        [call, reply, {"role": "assistant", "content": "The answer is 1,776."}],
        [call, reply],  # ended on the tool's reply: the model never answered
        [{"role": "assistant", "content": "The answer is 1777."}],
    ]
    assert correct_answer(episodes, ["1776"] * 3) == [1.0, 0.0, 0.0]


def test_a_warm_start_trace_trains_the_models_turns_and_reads_as_a_call():
    tokenizer = tool_tokenizer()
    row = {**make_problems(1, "train")[0]}
    row["prompt"] = [{"role": "user", "content": row["question"]}]
    ids, mask = trace_ids(tokenizer, row, with_tool=True, template_kwargs={})
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    call = json.dumps({"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}})
    assert trained == f"<tool_call>\n{call}\n</tool_call><|im_end|>The answer is {row['answer']}.<|im_end|>"
    read = tokenizer.decode(ids)
    assert f"<tool_response>\n{row['answer']}\n</tool_response>" in read and '"name": "multiply"' in read
    first_turn = ids[mask.index(1) : ids.index(tokenizer.eos_token_id, mask.index(1)) + 1]
    message = parse_turn(tokenizer, first_turn, ids[: mask.index(1)], [multiply])
    assert message["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}}

    ids, mask = trace_ids(tokenizer, row, with_tool=False, template_kwargs={})
    assert (
        tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        == f"The answer is {row['answer']}.<|im_end|>"
    )
    assert "<tools>" not in tokenizer.decode(ids)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tool_model")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, "qwen2")
    model.config.max_position_embeddings = 4096  # one token per byte: the tools' schema alone is ~1000 tokens
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_recipe_runs_both_arms_end_to_end(tiny_model_dir, tmp_path, capsys, caplog):
    out = tmp_path / "out"
    argv = [
        "--config", str(ROOT / "recipes" / "tools_cpu.yaml"),
        "--model_name_or_path", str(tiny_model_dir),
        "--num_train_examples", "4", "--num_eval_examples", "2", "--eval_batch_size", "2",
        "--warm_start_examples", "2", "--warm_start_batch_size", "2",
        "--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "16", "--disable_tqdm", "true", "--output_dir", str(out),
    ]  # fmt: skip
    results = recipe.main(argv)

    assert set(results) == {"tools", "no_tools"}
    report = json.loads((out / "eval.json").read_text())
    for arm in ("tools", "no_tools"):
        assert list(report[arm]["stages"]) == ["base", "warm start", "GRPO"]
        for stage in report[arm]["stages"].values():
            assert stage["n"] == 2 and 0.0 <= stage["accuracy"] <= 1.0 and 0.0 <= stage["tool_call_rate"] <= 1.0
        assert report[arm]["warm_start_log"][0]["loss"] > 0  # the warm start trained
        assert report[arm]["seconds"]["GRPO"] > 0
    assert "tools/call_frequency" in report["tools"]["grpo_log"][0]  # GRPO ran tool episodes in the tools arm only
    assert "tools/call_frequency" not in report["no_tools"]["grpo_log"][0]
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 3 * 2  # arms x stages x problems
    assert "more than max_completion_length=16" in caplog.text  # a byte per token: the traces do not fit, it says so
    table = capsys.readouterr().out
    assert "| tools | GRPO |" in table and "| no_tools | base |" in table


def test_shipped_config_parses():
    args, config = recipe.parse_args(["--config", str(ROOT / "recipes" / "tools_cpu.yaml")])
    assert args.model_name_or_path == "offline:SmolLM2-135M-Instruct" and args.arms == ["tools", "no_tools"]
    assert config.max_tool_calling_iterations == 2 and config.use_cpu and not config.bf16
    with pytest.raises(ValueError, match="arms"):
        recipe.parse_args(["--arms", "calculator"])
