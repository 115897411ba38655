"""Two machines on one host (tests/distributed/nodes.py): two launches of one gloo process each, rendezvous on
127.0.0.1, each machine with its own working directory, TMPDIR and caches, train exactly as one launch of two
processes does; what is per job is written once, what is per node once per node, what is per process by its process.

The two layouts differ where the ranks do: on two machines process 1 is node 1's local process 0, so a per-job write
guarded by the local rank happens twice, a per-process file named by the local rank is written by both processes,
and a per-node step guarded by the global rank is missing on node 1. On one machine, a per-node step guarded by
nothing runs twice. Two launches of the script (about 40 s each here) serve every test.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "distributed" / "nodes.py"
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
CASES = ("ddp", "fsdp2", "async1", "recipe")
TIMING = ("time", "runtime", "per_second", "throughput", "wait")  # log keys that measure the machine, not the run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine_env(node_dir: Path) -> dict[str, str]:
    """A machine of its own: working directory, TMPDIR and Hugging Face / XDG caches under `node_dir`."""
    for sub in ("work", "tmp", "hf", "cache"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in ("GRPO_HF_CACHE", "HF_HUB_CACHE")}
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {
        **env,
        "PYTHONPATH": os.pathsep.join(paths),
        "NODE_DIR": str(node_dir),
        "TMPDIR": str(node_dir / "tmp"),
        "HF_HOME": str(node_dir / "hf"),
        "XDG_CACHE_HOME": str(node_dir / "cache"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GLOO_SOCKET_IFNAME": "lo",  # loopback only
    }


def launch(node_dir: Path, nnodes: int, node_rank: int, nproc: int, port: int, script_args: list[str]):
    """One machine's `torch.distributed.run`, started (not waited for)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank)]
    command += ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    env = machine_env(node_dir)
    return subprocess.Popen(
        [*command, *script_args],
        cwd=node_dir / "work",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_machines(tmp: Path, nnodes: int, script: Path, *args: str, timeout: float = TIMEOUT_S) -> list[dict]:
    """Launch `script` on `nnodes` machines (2 processes in all) and wait for them: each machine's return code,
    output and seconds."""
    port = free_port()
    procs = [launch(tmp / f"node{r}", nnodes, r, 2 // nnodes, port, [str(script), *args]) for r in range(nnodes)]
    start, done = time.monotonic(), []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
        done.append({"rc": proc.returncode, "out": out, "err": err, "seconds": time.monotonic() - start})
    return done


def trained(tmp: Path, nnodes: int) -> dict:
    results, shared = tmp / "results", tmp / "shared"
    results.mkdir(parents=True)
    shared.mkdir()
    machines = run_machines(tmp, nnodes, SCRIPT, str(results), str(shared))
    for machine in machines:
        assert machine["rc"] == 0, machine["out"][-2000:] + machine["err"][-6000:]
    ranks = [torch.load(results / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"ranks": ranks, "shared": shared, "tmp": tmp}


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("one_machine"), nnodes=1)


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("two_machines"), nnodes=2)


def without_timing(logs: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(word in k for word in TIMING)} for row in logs]


def writers(run: dict, path: Path) -> list[int]:
    """The rank of every opening of `path` for writing, once per opening."""
    return [r for r, rank in enumerate(run["ranks"]) for written in rank["writes"] if written == str(path)]


def test_layouts_differ_where_the_ranks_do(one_machine, two_machines):
    assert [(r["node"], r["local_rank"]) for r in one_machine["ranks"]] == [(0, 0), (0, 1)]
    assert [(r["node"], r["local_rank"]) for r in two_machines["ranks"]] == [(0, 0), (1, 0)]


@pytest.mark.parametrize("case", CASES)
def test_two_machines_train_as_one(one_machine, two_machines, case):
    """Same logs (losses, rewards, KL, ...) at every step, and the same final parameters, exactly."""
    one, two = (run["ranks"][0]["cases"][case] for run in (one_machine, two_machines))
    assert len(one["logs"]) == 2 and all(row["grad_norm"] > 0 for row in one["logs"])
    assert without_timing(two["logs"]) == without_timing(one["logs"])
    if "params" in one:
        assert torch.equal(two["params"], one["params"])


@pytest.mark.parametrize("case", CASES)
def test_per_job_files_are_written_once(one_machine, two_machines, case):
    """Checkpoint trainer state, the completions log, the recipe's curve PNG and trainer_state.json: process 0
    writes them, once; on two machines too (process 1 is node 1's local main process, not the job's)."""
    for run in (one_machine, two_machines):
        out = run["shared"] / case
        per_job = [out / "checkpoint-2" / "trainer_state.json"]
        if case == "recipe":
            per_job += [out / "training_curves.png", out / "trainer_state.json", out / "eval.json"]
        for path in per_job:
            staged = out / ".saving" / path.relative_to(out)  # checkpoints are written there, then renamed
            assert path.is_file() and writers(run, path) + writers(run, staged) == [0], path
        log = out / "completions.jsonl"
        assert set(writers(run, log)) == {0}
    one, two = ((run["shared"] / case / "completions.jsonl").read_text() for run in (one_machine, two_machines))
    assert one == two and one.count("\n") > 0  # the same rows, once each


@pytest.mark.parametrize("case", CASES)
def test_per_process_state_is_written_by_its_process(two_machines, case):
    """Each process's run state in the checkpoint (and FSDP2's shards) is named by its global rank."""
    checkpoint = two_machines["shared"] / case / "checkpoint-2"
    for rank in (0, 1):
        name = f"grpo_hf_state_rank{rank}.pt"
        assert (checkpoint / name).is_file()
        assert set(writers(two_machines, checkpoint.parent / ".saving" / "checkpoint-2" / name)) == {rank}
    if case == "fsdp2":
        shards = sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]


def test_per_node_state_is_made_once_per_node(one_machine, two_machines):
    """The recipe's offline model is converted once per node, into that node's own cache: once on one machine of
    two processes, once on each of two machines."""
    one = [r["conversions"] for r in one_machine["ranks"]]
    assert len(one[0]) == 1 and one[1] == []
    assert one[0][0].startswith(str(one_machine["tmp"] / "node0" / "cache"))
    for node, rank in enumerate(two_machines["ranks"]):
        assert len(rank["conversions"]) == 1
        assert rank["conversions"][0].startswith(str(two_machines["tmp"] / f"node{node}" / "cache"))
        model = two_machines["tmp"] / f"node{node}" / "cache" / "grpo_hf"
        assert [json.loads(p.read_text())["model_type"] for p in model.glob("*/config.json")] == ["qwen2"]


FAULTS = Path(__file__).parent / "distributed" / "faults.py"
FAULT_BOUND_S = 150  # as tests/test_faults.py: the script sets ddp_timeout=60 s
MACHINE_FAULTS = {
    # stop_together names the process and, the job spanning two machines, its node and host
    "reward_raises": r"Failed while computing rewards on 1 of 2 processes \(process 1 on node 1 \([^)]+\): "
    r".*answer key is missing",
    # a process gone without a word: gloo names the peer's address on machine 0 (closed or reset, by timing), the
    # launcher of machine 1 its rank and signal
    "sigkill": r"\[127\.0\.0\.1\]:\d+: Connection (closed|reset) by peer|Connection (closed|reset) by peer \[127",
}


@pytest.mark.parametrize("mode", list(MACHINE_FAULTS))
def test_a_failure_on_machine_1_stops_machine_0_naming_it(tmp_path, mode):
    """A reward that raises (or a SIGKILL) on machine 1's process only: machine 0 exits non-zero, soon, and its own
    output says which process, on which machine, failed."""
    machine0, machine1 = run_machines(tmp_path, 2, FAULTS, str(tmp_path / "run"), mode, timeout=FAULT_BOUND_S)
    assert machine0["rc"] != 0 and machine1["rc"] != 0
    assert machine0["seconds"] < FAULT_BOUND_S
    output = machine0["out"] + machine0["err"]
    assert re.search(MACHINE_FAULTS[mode], output), output[-4000:]
    if mode == "sigkill":
        assert re.search(r"rank\s*: 1 \(local_rank: 0\)\s*\n\s*exitcode\s*: -9", machine1["err"]), machine1["err"][
            -3000:
        ]


def test_a_server_on_another_machine_without_a_shared_weights_dir_is_warned_of(tmp_path, monkeypatch, caplog):
    """The weights reach a vLLM server as files: /dev/shm (the default) is this machine's only."""
    from conftest import tiny_run_args

    from grpo_hf.rollout import vllm_server

    assert vllm_server.on_this_machine("http://127.0.0.1:8000") and vllm_server.on_this_machine("http://localhost:1")
    assert vllm_server.on_this_machine(f"http://{socket.gethostname()}:8000")
    assert not vllm_server.on_this_machine("http://198.51.100.7:8000")  # TEST-NET-2: another machine
    monkeypatch.setattr(vllm_server.VLLMServer, "connect", lambda self: "m")
    settings = dict(use_vllm=True, vllm_mode="server", use_cpu=True)
    for url, weights_dir, warned in [
        ("http://198.51.100.7:8000", None, True),
        ("http://198.51.100.7:8000", str(tmp_path), False),
        ("http://127.0.0.1:8000", None, False),
    ]:
        caplog.clear()
        args = tiny_run_args(tmp_path, settings, vllm_server_base_url=url, vllm_server_weights_dir=weights_dir)
        with caplog.at_level("WARNING", logger="grpo_hf"):
            vllm_server.VLLMServer(args, None, [2])
        assert ("cannot read" in caplog.text and "vllm_server_weights_dir" in caplog.text) == warned, url
