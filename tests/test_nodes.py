"""Two machines on one host (tests/distributed/nodes.py): two launches of one gloo process each, rendezvous on
127.0.0.1, each machine with its own working directory, TMPDIR and caches, train exactly as one launch of two
processes does; what is per job is written once, what is per node once per node, what is per process by its process.

The two layouts differ where the ranks do: on two machines process 1 is node 1's local process 0, so a per-job write
guarded by the local rank happens twice, a per-process file named by the local rank is written by both processes,
and a per-node step guarded by the global rank is missing on node 1. On one machine, a per-node step guarded by
nothing runs twice. Two launches of the script (about 40 s each here) serve every test.
"""

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
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
FAULT_BOUND_S = 150  # the script sets ddp_timeout=600 s: ending sooner is the heartbeat's doing (fault_timeout=10 s)
MACHINE_FAULTS = {
    # stop_together names the process and, the job spanning two machines, its node and host
    "reward_raises": r"Failed while computing rewards on 1 of 2 processes \(process 1 on node 1 \([^)]+\): "
    r".*answer key is missing",
    # a process gone without a word: its heartbeat stopped, so machine 0 names its process, node, host and pid (gloo
    # names an address only); the launcher of machine 1 names its rank and signal
    "sigkill": r"a process of this run is gone: process 1 on node 1 \([^)]+\), pid \d+: no heartbeat for \d+ s",
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
        relaunch_resumes_from_the_last_complete_checkpoint(tmp_path)


def test_a_hung_process_on_machine_1_ends_machine_0_within_fault_timeout(tmp_path):
    """Machine 1's process stops (SIGSTOP at the start of step 3: hung, its connections open, as when a node is lost
    without a word), so machine 0 waits in a collective whose timeout is 600 s. Its heartbeat's watchdog ends it
    within fault_timeout (10 s) and the check after it, with exit code 69 and a line naming the silent process."""
    from grpo_hf.parallel import PEER_LOST_EXIT_CODE

    port, args = free_port(), [str(FAULTS), str(tmp_path / "run"), "sigstop"]
    machines = [launch(tmp_path / f"node{rank}", 2, rank, 1, port, args) for rank in (0, 1)]
    start = time.monotonic()
    try:
        out, err = machines[0].communicate(timeout=FAULT_BOUND_S)
    except subprocess.TimeoutExpired:
        machines[0].kill()
        out, err = machines[0].communicate()
    seconds = time.monotonic() - start
    for pid in set(re.findall(r"process 1 on node 1 \([^)]+\), pid (\d+)", out + err)):  # the stopped process
        with contextlib.suppress(ProcessLookupError):  # (else its reaper kills it after 120 s)
            os.kill(int(pid), signal.SIGKILL)
    machines[1].kill()
    machines[1].communicate()
    output = out + err
    print(f"machine 0 exited {seconds:.1f} s after the launch:", *re.findall(r"no heartbeat for \d+ s", output))
    assert machines[0].returncode != 0 and seconds < FAULT_BOUND_S
    assert re.search(
        r"A process of this run is gone: process 1 on node 1 \([^)]+\), pid \d+: no heartbeat for \d+ s "
        r"\(fault_timeout=10 s\)",
        output,
    ), output[-4000:]
    assert re.search(rf"exitcode\s*: {PEER_LOST_EXIT_CODE}\b", err), err[-3000:]


def relaunch_resumes_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    """After the SIGKILL at the start of step 3: checkpoint-2 is the newest complete one. A checkpoint-3 half-written
    by grpo_hf (.saving/) and one without weights (another tool's, or older grpo_hf's) are left too: the same run
    launched again resumes from checkpoint-2 and trains to its end, although process 0 waits longer than
    fault_timeout twice (faults.py): the watchdog ends no healthy process."""
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    (run / ".saving" / "checkpoint-3").mkdir(parents=True)
    (run / ".saving" / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (run / "checkpoint-3").mkdir()
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")
    relaunched = run_machines(tmp_path, 2, FAULTS, str(run), "resume", timeout=FAULT_BOUND_S)
    for machine in relaunched:
        assert machine["rc"] == 0, machine["out"][-2000:] + machine["err"][-4000:]
        assert f"resuming from {run / 'checkpoint-2'}" in machine["out"] and "ended at step 4" in machine["out"]
    assert (
        "Skipping" in relaunched[0]["err"]
        and "checkpoint-3: it is incomplete (no model weights)" in relaunched[0]["err"]
    )


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


PREEMPT = Path(__file__).parent / "distributed" / "preempt.py"


def step_rows(output_dir: Path) -> list[dict]:
    """The per-step log rows of a finished recipe run (its trainer_state.json), without the machine's timings."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return without_timing([row for row in state["log_history"] if "loss" in row])


def saved_parameters(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output_dir / "model.safetensors")


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """recipes/gsm8k.py on two machines (synchronous, and max_staleness=1): each run to its end; stopped by SIGUSR1
    during the rollout of step 3; then the same command again."""
    from conftest import build_tiny_model, build_tiny_tokenizer

    tmp = tmp_path_factory.mktemp("preempted")
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, "qwen2", seed=5, tied=True).save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    shared = tmp / "shared"
    shared.mkdir()
    phases, stopped_dirs = {}, {}
    for phase in ("unbroken", "stopped", "resume"):
        phases[phase] = run_machines(tmp, 2, PREEMPT, str(tmp / "model"), str(shared), phase)
        if phase == "stopped":  # what the stop left
            stopped_dirs = {
                case: sorted(p.name for p in (shared / case / "run").iterdir()) for case in ("sync", "async1")
            }
    return phases, shared, stopped_dirs


def test_a_stopped_run_saves_exits_stopped_and_the_same_command_resumes_it_exactly(preempted):
    """SIGUSR1 to one process of two, mid-rollout: both finish the step, write its checkpoint (save_steps=500 would
    write none), skip the recipe's final save and exit with STOPPED_EXIT_CODE (through torchrun's launcher, which
    says 1 and reports the process's code); the same command again resumes from that checkpoint and ends with the
    unbroken run's per-step logs and parameters, exactly; at max_staleness=1 too."""
    from grpo_hf.checkpoint import STOPPED_EXIT_CODE

    phases, shared, stopped_dirs = preempted
    for phase in ("unbroken", "resume"):
        for machine in phases[phase]:
            assert machine["rc"] == 0, phase + machine["out"][-2000:] + machine["err"][-6000:]
    for machine, stopped_by in zip(phases["stopped"], ("a stop signal to another process", "SIGUSR1"), strict=True):
        output = machine["out"] + machine["err"]
        assert re.search(rf"exitcode\s*: {STOPPED_EXIT_CODE} ", machine["err"]), output[-6000:]
        assert re.search(f"Stopped by {stopped_by} after step [23], checkpoint written", output), output[-6000:]
    for case in ("sync", "async1"):
        unbroken, run = shared / case / "unbroken", shared / case / "run"
        (checkpoint,) = [name for name in stopped_dirs[case] if name.startswith("checkpoint-")]  # save_steps=500
        # the stop lands during step 3's rollout: in step 3, or at max_staleness=1 (sampled a step ahead) in step 2
        assert checkpoint == "checkpoint-3" or (case == "async1" and checkpoint == "checkpoint-2"), case
        assert not {"model.safetensors", "trainer_state.json", "training_curves.png"} & set(stopped_dirs[case])
        assert not (unbroken / checkpoint).exists()
        rows = step_rows(run)
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5] and rows == step_rows(unbroken), case
        mine, theirs = saved_parameters(run), saved_parameters(unbroken)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), case


class _Serving(http.server.BaseHTTPRequestHandler):
    """A vLLM server stand-in that answers what `VLLMServer.connect` reads, serving `served` (/v1/models' entry)."""

    served: dict = {}

    def do_GET(self):  # noqa: N802
        routes = {"/health": {}, "/version": {"version": "0.32.0"}, "/server_info": {}}
        routes["/v1/models"] = {"data": [{**self.served, "max_model_len": 64}]}
        body = json.dumps(routes[self.path.split("?")[0]]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_trainer_checks_at_connect_that_the_server_serves_its_model(tmp_path):
    """The policy's name_or_path, or the same parameter shapes under another name (read from the server's model
    path), pass; a model of other shapes, or one that cannot be read under another name, is an error naming both."""
    from conftest import build_tiny_model, build_tiny_tokenizer, tiny_run_args

    from grpo_hf.rollout.vllm_server import VLLMServer

    tokenizer = build_tiny_tokenizer()
    policy, other = build_tiny_model(tokenizer, "qwen2"), build_tiny_model(tokenizer, "qwen2", num_layers=3)
    for name, model in (("policy", policy), ("copy", policy), ("other", other)):
        model.save_pretrained(tmp_path / name)
    policy.config._name_or_path = str(tmp_path / "policy")
    handler = type("Handler", (_Serving,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    args = tiny_run_args(tmp_path, {}, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_cpu=True)
    try:
        for served in (
            {"id": str(tmp_path / "policy"), "root": str(tmp_path / "policy")},
            {"id": "policy", "root": str(tmp_path / "policy")},
            {"id": "my-policy", "root": str(tmp_path / "copy")},  # another name, the same shapes
        ):
            handler.served = served
            assert VLLMServer(args, None, [2], model_config=policy.config).model_id == served["id"]
        handler.served = {"id": "other", "root": str(tmp_path / "other")}
        with pytest.raises(ValueError, match=r"is not the model the vLLM server .* num_hidden_layers 2 \(server: 3\)"):
            VLLMServer(args, None, [2], model_config=policy.config)
        handler.served = {"id": "elsewhere", "root": "/on/the/server/only"}
        with pytest.raises(ValueError, match=r"cannot read to compare.*--served-model-name .*policy"):
            VLLMServer(args, None, [2], model_config=policy.config)
    finally:
        server.shutdown()
        server.server_close()
