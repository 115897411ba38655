"""Two gloo processes, one of which misbehaves: every process stops within a bounded time, saying which process
failed and why, and every checkpoint left on disk is complete (tests/distributed/faults.py)."""

import re
import time

import pytest
from conftest import torchrun

from grpo_hf.checkpoint import missing_files

BOUND_S = 150  # the script sets ddp_timeout=60 s; a launch on this machine takes ~10 s

CASES = {
    "reward_raises": r"Failed while computing rewards on 1 of 2 processes \(process 1: .*answer key is missing",
    "reward_times_out": r"Failed while computing rewards on 1 of 2 processes \(process 1: .*(timed out|timeout)",
    "short_shard": r"train_dataset differs between processes \(process 0: 12 rows, process 1: 8 rows",
    "sigkill": r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9",
}


@pytest.mark.parametrize("mode", list(CASES))
def test_every_process_stops_soon_with_a_message_naming_the_failure(tmp_path, mode):
    start = time.monotonic()
    result = torchrun("faults.py", tmp_path / "run", mode, timeout=BOUND_S, check=False)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < BOUND_S
    assert re.search(CASES[mode], output, flags=re.IGNORECASE), output[-4000:]
    if mode != "sigkill":  # a Python error: both processes report it, not only the one it happened on
        assert "[rank0]" in output and "[rank1]" in output
        for rank in ("rank0", "rank1"):
            lines = [line for line in output.splitlines() if line.startswith(f"[{rank}]:") and "Error:" in line]
            assert any(re.search(CASES[mode], line) for line in lines), (rank, lines[-3:])
    for checkpoint in (tmp_path / "run").glob("checkpoint-*"):
        assert missing_files(str(checkpoint)) == [], checkpoint
