"""recipes/tools.py: the problems and their split, the warm-start traces, and a short run on a tiny model."""

import json
from pathlib import Path

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer, load_recipe
from transformers.utils import get_json_schema

from grpo_hf.rollout.tools import parse_turn, tool_chat_template

ROOT = Path(__file__).resolve().parents[1]


recipe = load_recipe("tools")
from tools_support.evaluation import greedy_engine  # noqa: E402
from tools_support.problems import correct_answer, make_problems, multiply, split_of  # noqa: E402
from tools_support.warm_start import calls_tool, trace_ids  # noqa: E402


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


def test_problems_take_a_three_digit_factor_in_either_place():
    test = make_problems(64, "test", seed=0, digits=[3, 2])
    assert all(sorted([len(str(a)), len(str(b))]) == [2, 3] for a, b in zip(test["a"], test["b"], strict=True))
    assert {len(str(a)) for a in test["a"]} == {2, 3}  # the 3-digit factor comes first in some, second in others
    train = make_problems(300, "train", seed=0, digits=[3, 2])
    pairs = lambda ds: {(min(a, b), max(a, b)) for a, b in zip(ds["a"], ds["b"], strict=True)}  # noqa: E731
    assert not pairs(train) & pairs(test)
    with pytest.raises(ValueError, match="digits"):
        make_problems(1, "train", digits=[3])


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

    ids, mask = trace_ids(
        tokenizer, row, with_tool=True, template_kwargs={}, calls=False
    )  # the tool shown, not called
    assert "<tools>" in tokenizer.decode(ids)
    assert (
        tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        == f"The answer is {row['answer']}.<|im_end|>"
    )


def test_the_warm_start_calls_on_an_even_share_of_its_traces():
    assert [calls_tool(i, 0.5) for i in range(6)] == [False, True] * 3
    assert [sum(calls_tool(i, f) for i in range(12)) for f in (0.0, 0.25, 1 / 3, 0.34, 0.5, 1.0)] == [
        0,
        3,
        4,
        4,
        6,
        12,
    ]
    assert all(calls_tool(i, 1.0) for i in range(12))


def test_greedy_episodes_pick_what_generate_picks_turn_by_turn():
    """The evaluation's decoder (`greedy_engine`, its episode cache on): every turn of every episode is what greedy
    `model.generate` picks on the same context (the prompt, the earlier turns and the tool replies), and the cache
    served context tokens instead of prefilling them again."""
    import torch

    from grpo_hf.rollout.episodes import EpisodeRunner
    from grpo_hf.rollout.hf_generate import GenerateEngine
    from grpo_hf.rollout.prompts import tokenize_prompts

    tokenizer = tool_tokenizer()
    model = build_tiny_model(tokenizer, "qwen2", hidden_size=64).eval()
    model.config.max_position_embeddings = 4096  # one token per byte: the tool's schema alone is ~500 tokens
    with torch.no_grad():  # turns that end after a few tokens, so that episodes take several
        model.lm_head.weight[tokenizer.eos_token_id] *= 3
    prompts = [[{"role": "user", "content": text}] for text in ("Hi", "Multiply 123 by 45, please.", "7 x 8?")]
    row_tools = [[multiply]] * len(prompts)
    ids, mask, _ = tokenize_prompts(tokenizer, prompts, None, {}, tools=row_tools)
    eos, budget = [tokenizer.eos_token_id], 256
    runner = EpisodeRunner(tokenizer, max_completion_length=budget, eos_token_ids=eos, max_tool_calling_iterations=2)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 3}}}
    runner.parse = lambda *_: {"role": "assistant", "content": "", "tool_calls": [call]}  # every turn calls
    engine = greedy_engine(model, tokenizer, budget)
    episodes = runner.run_joining(lambda source: engine.decode_turns(model, source), ids, mask, row_tools)

    reference = GenerateEngine(engine.generation_config, eos)
    turns = 0
    for row, (prompt, keep) in enumerate(zip(ids, mask, strict=True)):
        completion = episodes.completion_ids[row].tolist()
        sampled = episodes.completion_mask[row].tolist()
        starts = [t for t, s in enumerate(sampled) if s and (t == 0 or not sampled[t - 1])]
        for t in starts:
            end = next((u for u in range(t, len(sampled)) if not sampled[u]), len(sampled))
            context = torch.tensor([prompt[keep.bool()].tolist() + completion[:t]])  # [1, L]
            expected = reference.generate(model, context, torch.ones_like(context), max_new_tokens=budget - t)
            picked = expected.completion_ids[0][expected.completion_mask[0].bool()].tolist()
            assert completion[t:end] == picked and picked
            turns += 1
    assert turns == sum(episodes.turns) == 3 * len(prompts)  # each episode: 2 rounds of calls, then its last turn
    assert engine.episode_cache.stats["reused_tokens"] > 0 and engine.episode_cache.stats["hits"] > 0


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
        "--model_name_or_path", str(tiny_model_dir), "--seeds", "1", "2",
        "--num_train_examples", "4", "--num_eval_examples", "2", "--eval_batch_size", "2",
        "--warm_start_examples", "2", "--warm_start_batch_size", "2",
        "--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "16", "--disable_tqdm", "true", "--output_dir", str(out),
    ]  # fmt: skip
    results = recipe.main(argv)

    assert set(results) == {"tools", "no_tools"}
    report = json.loads((out / "eval.json").read_text())
    metrics = {"accuracy", "tool_call_rate", "failed_call_rate", "mean_turns", "n"}
    for arm in ("tools", "no_tools"):
        assert list(report[arm]["stages"]) == ["base", "warm start"] and list(report[arm]["runs"]) == ["1", "2"]
        evaluated = [*report[arm]["stages"].values(), *(run["GRPO"] for run in report[arm]["runs"].values())]
        for stage in evaluated:
            assert set(stage) == metrics and stage["n"] == 2 and stage["mean_turns"] >= 1
            assert all(0.0 <= stage[k] <= 1.0 for k in ("accuracy", "tool_call_rate", "failed_call_rate"))
        grpo = [run["GRPO"]["accuracy"] for run in report[arm]["runs"].values()]
        summary = report[arm]["over_seeds"]["GRPO"]["accuracy"]
        assert summary == {"mean": sum(grpo) / 2, "min": min(grpo), "max": max(grpo)}
        assert report[arm]["warm_start_log"][0]["loss"] > 0  # the warm start trained
        assert all(run["seconds"]["GRPO"] > 0 for run in report[arm]["runs"].values())
    for seed in ("1", "2"):  # GRPO ran tool episodes in the tools arm only
        assert "tools/call_frequency" in report["tools"]["runs"][seed]["grpo_log"][0]
        assert "tools/call_frequency" not in report["no_tools"]["runs"][seed]["grpo_log"][0]
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * (2 + 2) * 2  # arms x (base, warm start, GRPO per seed) x problems
    assert "more than max_completion_length=16" in caplog.text  # a byte per token: the traces do not fit, it says so
    table = capsys.readouterr().out
    assert "| tools | GRPO seed 2 |" in table and "| no_tools | base |" in table
    assert "failed-call rate | mean turns" in table
    assert "| no_tools | GRPO mean [min, max] over 2 seeds | 0.000 [0.000, 0.000] |" in table


def test_shipped_config_parses():
    args, config = recipe.parse_args(["--config", str(ROOT / "recipes" / "tools_cpu.yaml")])
    assert args.model_name_or_path == "offline:SmolLM2-135M-Instruct" and args.arms == ["tools", "no_tools"]
    assert len(args.seeds) == 3 and args.num_eval_examples >= 64 and 0 < args.warm_start_tool_fraction < 1
    assert config.max_tool_calling_iterations == 2 and config.use_cpu and not config.bf16
    with pytest.raises(ValueError, match="arms"):
        recipe.parse_args(["--arms", "calculator"])
