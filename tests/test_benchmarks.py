"""The benchmark scripts run: the one worker trains a tiny step with each trainer and records what `vs_trl.py`
summarises, and `vs_trl.py`'s summary reads those records as documented (docs/benchmarks.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _worker  # noqa: E402
import vs_trl  # noqa: E402


def run_script(*command: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


@pytest.mark.parametrize("impl", ["trl", "grpo_hf"])
def test_the_worker_trains_one_tiny_step_and_records_it(tmp_path, impl):
    out = tmp_path / "run.json"
    options = ["--impl", impl, "--config", "a", "--tiny", "--steps", "1", "--out", str(out)]
    result = run_script("benchmarks/_worker.py", *options, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["status"] == "ok" and len(record["step_seconds"]) == 1 and record["step_seconds"][0] > 0
    # generation timed inside the step: 2 prompts x G=2, up to 8 tokens each
    assert 0 < record["generate_seconds"][0] < record["step_seconds"][0]
    assert 1 <= record["decode_steps"][0] <= 8 and len(record["rewards"]) == 1
    assert 0 < record["completion_tokens"][0] <= 4 * 8
    assert record["peak_rss_mib"] > record["rss_start_mib"] > 0 and "peak_cuda_mib" not in record
    assert record["engine"] == ("model.generate" if impl == "trl" else "loop")
    if impl == "grpo_hf":  # where the step went (profile_step.py): generation and the reference forward inside it
        assert record["fast_path"] is True and any("rollout engine: loop" in line for line in record["engine_log"])
        phases = record["phases"][0]
        assert (
            phases["training_step"] > record["generate_seconds"][0] + phases["rewards"] + phases["no-grad log-probs"]
        )
        assert phases["no-grad log-probs"] > 0 and phases["training_step"] < record["step_seconds"][0]


def test_the_summary_times_whole_rounds_after_the_first_and_compares_to_the_first_trainer():
    """num_iterations=2: a round is a generating step and a reusing one, averaged; the first round is not timed."""
    run = {
        "status": "ok", "engine": "loop", "step_seconds": [9.0, 9.0, 4.0, 2.0, 6.0, 4.0],
        "generate_seconds": [5.0, 0.0, 2.0, 0.0, 3.0, 0.0], "decode_steps": [8, 0, 10, 0, 10, 0],
        "completion_tokens": [50.0, 0.0, 60.0, 0.0, 90.0, 0.0], "rewards": [0.0, 0.5, 1.0],
        "peak_rss_mib": 1000.0,
    }  # fmt: skip
    s = vs_trl.summarise([run], num_iterations=2)
    assert s["s_per_step"] == pytest.approx(4.0)  # median of (4 + 2) / 2 and (6 + 4) / 2
    assert s["generate_s_per_step"] == pytest.approx(1.25)  # median of 2 / 2 and 3 / 2
    assert s["decode_ms_per_token"] == pytest.approx(1000 * 5.0 / 20)
    assert s["tokens_per_s"] == pytest.approx(150.0 / 16.0) and s["first_step_s"] == 9.0
    assert s["rss_mib"] == 1000.0 and s["reward"] == pytest.approx(0.5)
    faster = {**s, "s_per_step": 2.0, "rss_mib": 500.0}
    assert vs_trl.compare(s, faster, "s_per_step", "faster") == "0.50x time (2.00x faster)"
    assert vs_trl.compare(s, faster, "rss_mib", "x") == "0.50x"
    assert vs_trl.summarise([{**run, "status": "oom"}], 2) == {"status": "OOM"}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3", "qwen3_moe"])
def test_each_family_model_is_about_smollm2_135m_in_its_own_shape(family):
    """Built on the meta device (no memory, no weights): within 20% of SmolLM2-135M's parameters, tied embeddings."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _worker.family_config(family, 49_152, dict(bos_token_id=1, eos_token_id=2, pad_token_id=2))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = dict(qwen3="Qwen3", qwen3_5="Qwen3_5", gemma3="Gemma3", qwen3_moe="Qwen3Moe")
    assert type(model).__name__ == f"{names[family]}ForCausalLM" and model.config.tie_word_embeddings
    assert abs(sum(p.numel() for p in model.parameters()) / 135e6 - 1) < 0.2
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    expected = {"qwen3_5": {"linear_attention", "full_attention"}, "gemma3": {"sliding_attention", "full_attention"}}
    assert layers == expected.get(family, {"full_attention"})
    assert getattr(config, "sliding_window", None) == (_worker.SLIDING_WINDOW if family == "gemma3" else None)
    if family == "qwen3_moe":  # both trainers ask for the router logits in training, and pay for the loss
        assert config.router_aux_loss_coef > 0 and not config.output_router_logits  # not in generation


def test_the_family_table_gives_each_family_the_speed_and_memory_ratios():
    trl, ours = {"s_per_step": 3.0, "rss_mib": 1000.0}, {"s_per_step": 2.0, "rss_mib": 500.0}
    summaries = {"a": {"TRL": trl, "grpo_hf": ours}, "fam-gemma3": {"TRL": trl, "grpo_hf": {"status": "error"}}}
    summaries["fam-qwen3"] = {"TRL": trl, "grpo_hf": ours}
    rows = vs_trl.family_table(summaries, ["TRL", "grpo_hf"], cuda=False).splitlines()
    assert rows[0].startswith("| family | TRL s/step | grpo_hf s/step | speed vs TRL | TRL peak MiB |")
    assert rows[2:] == [
        "| gemma3 | 3.00 | n/a | n/a | 1,000 | n/a | n/a |",
        "| qwen3 | 3.00 | 2.00 | 1.50x | 1,000 | 500 | 0.50x |",
    ]


def test_a_lost_cuda_graph_is_named_so_that_it_cannot_pass_for_a_slow_engine():
    replayed = {"compile": {"cudagraph_skips": 0}, "engine_log": [], "replay_decode_steps": 256, "graph_launches": 255}
    assert _worker.lost_graph(replayed) is None  # the first token is eager
    assert "skipped CUDA graphs 2 time(s)" in _worker.lost_graph({**replayed, "compile": {"cudagraph_skips": 2}})
    assert "3 CUDA graph launches for 256 decoded tokens" in _worker.lost_graph({**replayed, "graph_launches": 3})
    eager = {**replayed, "engine_log": ["WARNING: cuda_graph: the 64-row bucket runs eagerly: ..."]}
    assert "runs eagerly" in _worker.lost_graph(eager)


@pytest.mark.benchmark
def test_every_config_and_layout_runs_end_to_end_at_tiny_size():
    configs = "a,b,J3,tools,vlm_frozen"
    result = run_script(
        "benchmarks/vs_trl.py", "--tiny", "--configs", configs, "--reps", "1", "--rollouts", "2", timeout=1800
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        result.stdout.strip().splitlines()[-1].startswith("speedup=") and "nan" not in result.stdout.splitlines()[-1]
    )
    for compare, row in (("ddp", "| 2 processes, padded |"), ("fsdp2", "| FSDP2 | 1 |")):
        result = run_script(
            "benchmarks/multi_process.py", "--tiny", "--steps", "2", "--compare", compare, timeout=1800
        )
        assert result.returncode == 0 and row in result.stdout, result.stderr[-3000:]
    result = run_script("benchmarks/profile_step.py", "--tiny", "--config", "J1", "--steps", "2", timeout=600)
    assert result.returncode == 0 and "| total |" in result.stdout, result.stderr[-3000:]
    options = ["--layers", "1", "--prompts", "1", "--length", "4", "--paths", "trl-triton,trl,per-group,padded"]
    result = run_script("benchmarks/launch_count.py", *options, timeout=600)
    assert result.returncode == 0 and "| grpo_hf: padded batch" in result.stdout, result.stderr[-3000:]


def test_launch_count_counts_a_launch_per_kernel_and_host_syncs_apart():
    """Views launch nothing, a CPU's scalar cast or output fill stays inside its operator, a `_foreach_*` operator is
    one launch, `.item()` is a host sync, and generation is dropped (docs/benchmarks.md)."""
    import launch_count
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("count:step"):
            y = x.t().contiguous()  # a view, then one copy
            (y + 1).sum().item()  # add (a CPU casts the 1 first), sum (a CPU fills its output first), a sync
            with record_function("count:generation"):
                x * 2
        torch._foreach_add_([x, y], 1.0)  # a CPU loops over the tensors
    counts = launch_count.tally(prof.events())
    assert counts["loss fwd+bwd"] == {"aten::copy_": 1, "aten::add": 1, "aten::sum": 1, "host syncs": 1}
    assert counts["optimizer and rest"] == {"aten::_foreach_add_": 1} and not counts["no-grad log-probs"]


def test_the_async_benchmark_prints_its_table_on_a_tiny_model():
    result = run_script("benchmarks/async_overlap.py", "--tiny", "--steps", "3", "--tokens", "8", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| latency", "| compute"))]
    assert [row.split("|")[3].strip() for row in rows] == ["0", "1", "0", "1", "2"]  # max_staleness per row
    assert all(float(row.split("|")[4]) > 0 for row in rows)  # steps per second


@pytest.mark.benchmark
def test_the_multi_turn_benchmark_prints_both_arms_their_ratios_and_the_targets():
    result = run_script("benchmarks/multi_turn.py", "--smoke", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| arm |")))
    assert lines[header].split("|")[2:-1] == [
        " prefill tokens/episode ", " computed with padding/episode ", " new tokens/episode ", " turns/episode ",
        " shared prefix tokens ", " decode steps' padded key columns ", " s/rollout ", " peak MB ",
    ]  # fmt: skip
    rows = [line.split("|")[1].strip() for line in lines[header + 2 : header + 5]]
    assert rows == ["today", "after", "after/today"]
    today, after = (line.split("|") for line in lines[header + 2 : header + 4])
    assert float(after[2].replace(",", "")) < float(today[2].replace(",", ""))  # fewer tokens prefilled
    assert int(today[6].replace(",", "")) == int(after[6].replace(",", "")) > 0  # the prompts' shared prefix
    assert sum(line.startswith("target: ") for line in lines) == 3  # prefill tokens, prefill positions, time
    assert any(line.startswith("same tokens, seed 0: ") and line.endswith("/2 episodes") for line in lines)
    assert "system block" in lines[0] and any("episode cache, seed 0: {" in line for line in lines)


@pytest.mark.vllm
def test_the_vllm_sync_benchmark_measures_a_tiny_model():
    """benchmarks/vllm_sync.py --tiny (in .venv-vllm): one vLLM rollout, one push, and the log-prob gaps, the training
    forward's path taken from its `ForwardPlan` (the script passed the model where the plan goes, and failed)."""
    result = run_script("benchmarks/vllm_sync.py", "--tiny", "--pushes", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert record["completion_tokens"] > 0 and len(record["push_seconds"]) == 1
    assert record["vllm_vs_old_logps"]["max"] < 1e-4 and record["old_vs_training_logps"]["max"] < 1e-4
