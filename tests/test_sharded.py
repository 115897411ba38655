"""Sharded training for real: FSDP2 and DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo) train the same model as DDP.

Two launches of `tests/distributed/sharded.py` (a run killed with SIGKILL; then every layout and case, about 30 s in
all) serve every test here: per-step losses, rewards and KLs equal DDP's for full fine-tuning (beta 0.04 with a
separate, sharded reference; beta 0 with `model.generate`), `num_iterations=2`, `steps_per_generation=2` and LoRA;
generation gathers the weights a fixed number of times per rollout, not per token; the killed run resumes from its
sharded checkpoint as if unbroken; `save_model` writes a model that loads.
The ZeRO tests need the optional extra `pip install deepspeed` and are skipped without it.
"""

import importlib
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "distributed"))

from sharded import CASES, STEPS  # noqa: E402

SCRIPT = Path(__file__).parent / "distributed" / "sharded.py"


def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A 3-step FSDP2 run whose process 1 was SIGKILLed once its sharded checkpoint of step 2 was written."""
    run_dir = tmp_path_factory.mktemp("killed")
    done = launch("--killed", str(run_dir))
    assert done.returncode != 0, "the run was to be killed"
    assert "Signal 9" in done.stderr or "SIGKILL" in done.stderr, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def results(tmp_path_factory, killed_run):
    out = tmp_path_factory.mktemp("sharded") / "out.pt"
    done = launch(str(out), str(killed_run))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_trains_the_model_ddp_trains(results, case):
    ddp, fsdp = results["cases"][case]["ddp"], results["cases"][case]["fsdp"]
    assert fsdp["sharded"] and not ddp["sharded"]  # DTensor shards, and really not
    assert len(ddp["loss"]) == len(fsdp["loss"]) == STEPS
    assert fsdp["reward"] == ddp["reward"]  # the same completions were sampled at every step
    assert torch.allclose(torch.tensor(fsdp["loss"]), torch.tensor(ddp["loss"]), rtol=0, atol=1e-6)
    assert torch.allclose(torch.tensor(fsdp["kl"]), torch.tensor(ddp["kl"]), rtol=0, atol=1e-6)
    assert any(abs(loss) > 1e-4 for loss in ddp["loss"])  # a comparison of non-trivial values
    if ddp["ref_logps"] is not None:  # beta != 0: the reference (a sharded copy, or the adapters off) agrees
        assert torch.allclose(fsdp["ref_logps"], ddp["ref_logps"], rtol=0, atol=1e-5)
        assert fsdp["reference_sharded"] == (not CASES[case].get("lora"))  # LoRA: no copy, the adapters switched off
        if not CASES[case].get("lora"):  # each decoder layer a unit, as the policy's: gathered one at a time
            assert fsdp["reference_units"] >= 3  # 2 decoder layers and the root


needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install deepspeed")


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trains_the_model_ddp_trains(results, stage):
    """accelerate's DeepSpeed path (DeepSpeed's CPU accelerator, the trainer's AdamW), beta 0.04: ZeRO-3 partitions
    the policy and the reference (every tensor), ZeRO-2 neither; the final save loads and gives the trained logits."""
    ddp, zero = results["cases"]["beta"]["ddp"], results["cases"]["beta"][f"zero{stage}"]
    assert zero["sharded"] == zero["reference_sharded"] == (stage == 3)
    assert zero["reward"] == ddp["reward"]
    assert torch.allclose(torch.tensor(zero["loss"]), torch.tensor(ddp["loss"]), rtol=0, atol=1e-6)
    assert torch.allclose(torch.tensor(zero["kl"]), torch.tensor(ddp["kl"]), rtol=0, atol=1e-6)
    assert torch.allclose(zero["ref_logps"], ddp["ref_logps"], rtol=0, atol=1e-5)
    trained, loaded = results[f"saved_zero{stage}"]
    assert torch.allclose(loaded, trained, rtol=0, atol=1e-6)


@needs_deepspeed
def test_zero2_trains_at_max_staleness_1(results):
    """Asynchronous GRPO under ZeRO-2: each process's producer samples from its own whole copy of the policy."""
    run, ddp = results["cases"]["beta"]["zero2_async"], results["cases"]["beta"]["ddp"]
    assert run["async/staleness_max"] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(loss) for loss in run["loss"]) and run["loss"] != ddp["loss"]  # other batches: stale


@needs_deepspeed
def test_zero3_samples_without_gathering_the_model_when_asked(results):
    """ds3_gather_for_generation=False: every rollout samples with the partitioned model (`model.generate`, whose
    processes decode in step) and trains what DDP trains with the same engine."""
    run, ddp = results["zero3_no_gather"], results["cases"]["beta0"]["ddp"]
    assert run["engine"] == "generate" and run["partitioned_while_sampling"] == [True] * STEPS
    assert run["reward"] == ddp["reward"]
    assert torch.allclose(torch.tensor(run["loss"]), torch.tensor(ddp["loss"]), rtol=0, atol=1e-6)


def test_lora_adapters_agree_across_processes(results):
    for layout in ("ddp", "fsdp"):
        adapters = results["cases"]["lora"][layout]["adapters"]  # [processes, n] before DDP's broadcast
        assert torch.equal(adapters[0], adapters[1]), layout
    assert torch.equal(results["cases"]["lora"]["ddp"]["adapters"], results["cases"]["lora"]["fsdp"]["adapters"])


def test_generation_gathers_once_per_rollout_whatever_the_length(results):
    per_length = results["gathers_per_rollout"]  # {max_completion_length: [all-gathers per rollout]}
    (short,), (long,) = per_length[4], per_length[16]
    assert short == long  # per rollout, not per token (each decoder layer's unit was gathered 16 times before)
    assert 0 < short <= 5  # one all-gather per shard unit: 2 decoder layers, the root (and LoRA's own)
    for case in CASES:  # the same count at every rollout of every case
        assert len(set(results["cases"][case]["fsdp"]["gathers"])) == 1, case


def test_a_run_killed_after_a_sharded_checkpoint_resumes_as_if_unbroken(results, killed_run):
    assert sorted(p.name for p in killed_run.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (killed_run / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # sharded: one part per process
    unbroken, resumed = results["cases"]["beta"]["fsdp"], results["resumed"]
    assert len(resumed["loss"]) == STEPS and resumed["reward"] == unbroken["reward"]
    assert torch.allclose(torch.tensor(resumed["loss"]), torch.tensor(unbroken["loss"]), rtol=0, atol=1e-7)
    assert torch.allclose(torch.tensor(resumed["kl"]), torch.tensor(unbroken["kl"]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", ["beta", "lora"])
def test_save_model_writes_the_trained_model_under_fsdp2(results, case):
    """With a sharded state dict, Trainer's save_model wrote nothing; the saved model (or LoRA adapter) now loads
    with `from_pretrained` and gives the trained (sharded) model's logits."""
    trained, loaded = results[f"saved_{case}"]
    assert loaded is not None and loaded.shape == trained.shape
    assert torch.allclose(loaded, trained, rtol=0, atol=1e-6)
