"""recipes/slurm/grpo.sbatch on a fake 3-node allocation: `scontrol`, `srun`, `curl` and `accelerate` are stand-ins
on PATH that record their arguments, so the commands the script would run are checked without SLURM or GPUs; the
training command's recipe arguments are parsed by the recipe's own parser, into the `GRPOConfig` it trains with.
The stop is played out too: USR1 to the batch script reaches the training step, whose stopped exit code requeues the
job once the server is stopped; and train_node.sh passes a stop to its training processes, not to the launcher."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import load_recipe

from grpo_hf.checkpoint import STOPPED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "recipes" / "slurm" / "grpo.sbatch"
TRAIN_NODE = ROOT / "recipes" / "slurm" / "train_node.sh"
NODES = ("gpu-a", "gpu-b", "gpu-c")
IPS = {"gpu-a": "10.0.0.1", "gpu-b": "10.0.0.2", "gpu-c": "10.0.0.3"}
RECORDER = """#!{python}
import json, os, signal, sys, time
argv = sys.argv[1:]
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": argv}}) + "\\n")
tool = os.path.basename(sys.argv[0])
if tool == "scontrol" and argv[:2] == ["show", "hostnames"]:
    print("\\n".join({nodes!r}))
if tool == "srun" and "recipes/slurm/node_ip.sh" in argv:  # the node's address, as node_ip.sh finds it there
    print({ips!r}[next(a for a in argv if a.startswith("--nodelist=")).split("=")[1]])
if tool == "srun" and "recipes/slurm/train_node.sh" in argv and os.environ.get("TRAINING") == "until_stopped":
    def stopped(signum, frame):  # as the training tasks do: save, then exit with the stopped code
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps({{"tool": "srun", "signal": signal.Signals(signum).name}}) + "\\n")
        sys.exit({stopped})
    signal.signal(signal.SIGUSR1, stopped)
    time.sleep(60)
    sys.exit(1)
if tool == "srun" and "grpo_hf.vllm_serve" in argv and os.environ.get("TRAINING") == "until_stopped":
    def stopped(signum, frame):  # the server, stopped by the batch script
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps({{"tool": "srun", "server": signal.Signals(signum).name}}) + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
    time.sleep(60)
"""

recipe = load_recipe("gsm8k")


def fake_tools(bin_dir: Path) -> None:
    """`scontrol show hostnames` prints NODES (other scontrol calls are recorded); `srun` runs node_ip.sh as each node
    would (IPS); `srun`, `curl` (the server answers at once) and `accelerate` record their arguments in $CALLS and
    succeed, or, with TRAINING=until_stopped, the training srun waits for SIGUSR1 and exits with the stopped code."""
    bin_dir.mkdir()
    for tool in ("scontrol", "srun", "curl", "accelerate"):
        text = RECORDER.format(python=sys.executable, nodes=list(NODES), ips=IPS, stopped=STOPPED_EXIT_CODE)
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)


def job_env(tmp: Path, calls: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(calls),
        "MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "LOG_DIR": str(tmp / "logs"),
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Every command the script runs in a job of 3 nodes, 8 GPUs each, submitted from the repository."""
    tmp = tmp_path_factory.mktemp("slurm")
    fake_tools(tmp / "bin")
    calls = tmp / "calls.jsonl"
    env = job_env(tmp, calls)
    args = ["--config", "recipes/gsm8k_vllm.yaml", "--output_dir", str(tmp / "out")]
    done = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()], env, tmp


def steps(calls: list[dict]) -> tuple[dict, dict]:
    """The server's srun and the training srun (the address look-ups left out)."""
    server, training = [c for c in calls if c["tool"] == "srun" and "recipes/slurm/node_ip.sh" not in c["argv"]]
    return server, training


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_last_node_serves_the_first_trains_as_main(rendered):
    calls, _, _ = rendered
    (health,) = [call for call in calls if call["tool"] == "curl"]  # the server's srun runs in the background
    server, training = steps(calls)
    assert "--nodelist=gpu-c" in server["argv"] and "--nodes=1" in server["argv"]
    serve = server["argv"][server["argv"].index("python") :]
    assert serve[:3] == ["python", "-m", "grpo_hf.vllm_serve"]
    assert flag(serve, "--model") == "Qwen/Qwen2.5-0.5B-Instruct" and flag(serve, "--host") == "10.0.0.3"  # its IP
    assert flag(serve, "--port") == "8000"
    assert flag(serve, "--tensor-parallel-size") == "1" and flag(serve, "--data-parallel-size") == "8"  # every GPU
    assert health == {"tool": "curl", "argv": ["-sf", "--max-time", "10", "http://10.0.0.3:8000/health"]}
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu-a,gpu-b"} <= set(training["argv"])
    launch = training["argv"][training["argv"].index("recipes/slurm/train_node.sh") + 1 :]
    assert flag(launch, "--main_process_ip") == "10.0.0.1" and flag(launch, "--num_machines") == "2"
    assert flag(launch, "--num_processes") == "16" and flag(launch, "--config_file") == "recipes/accelerate/ddp.yaml"
    assert not [c for c in calls if c["tool"] == "scontrol" and c["argv"][0] == "requeue"]  # it ended: no requeue
    lookups = [c["argv"] for c in calls if c["tool"] == "srun" and "recipes/slurm/node_ip.sh" in c["argv"]]
    assert [next(a for a in argv if a.startswith("--nodelist=")) for argv in lookups] == [
        "--nodelist=gpu-c",
        "--nodelist=gpu-a",
    ]


def test_a_dead_node_ends_the_job_and_each_node_logs_apart(rendered):
    """The training step ends when a task fails, FAULT_TIMEOUT_S after the first ends at most; the rendezvous times out
    and the heartbeat's watchdog ends a silent peer's survivors after as long (the collectives keep their long
    timeout); each node's output goes to its own labelled log, the server's too."""
    calls, _, tmp = rendered
    server, training = steps(calls)
    assert {"--kill-on-bad-exit=1", "--wait=120"} <= set(training["argv"])
    launch = training["argv"][training["argv"].index("recipes/slurm/train_node.sh") + 1 :]
    assert flag(launch, "--rdzv_backend") == "static" and flag(launch, "--rdzv_conf") == "timeout=120"
    assert flag(launch, "--fault_timeout") == "120" and flag(launch, "--ddp_timeout") == "1800"
    for step in (server, training):
        assert {"--label", f"--output={tmp / 'logs'}/%x-%j-%n.out", "--open-mode=append"} <= set(step["argv"])
    assert (tmp / "logs").is_dir()


def test_the_job_asks_for_its_stop_signal_requeue_and_resources():
    directives = re.findall(r"^#SBATCH (\S+)", SBATCH.read_text(), flags=re.M)
    names = {d.split("=")[0] for d in directives}
    assert {"--signal=B:USR1@600", "--requeue", "--open-mode=append"} <= set(directives)
    assert {"--cpus-per-task", "--mem", "--time", "--nodes", "--gres"} <= names


def test_the_server_address_reaches_grpo_config(rendered, monkeypatch):
    """The recipe's parser reads the rendered training command: the server's URL, server mode and the network weight
    transfer (NCCL on vllm_group_port, no weights directory: nothing shared is written) land in GRPOConfig, over the
    YAML's colocate mode."""
    calls, _, tmp = rendered
    training = steps(calls)[1]["argv"]
    recipe_argv = training[training.index("recipes/gsm8k.py") + 1 :]
    monkeypatch.chdir(ROOT)  # the command's paths are relative to the submit directory
    script_args, config = recipe.parse_args([*recipe_argv, "--bf16", "false"])  # the YAML's bf16 needs a GPU here
    assert config.use_vllm and config.vllm_mode == "server"
    assert config.vllm_server_base_url == "http://10.0.0.3:8000"  # the server node's address, not its name
    assert config.vllm_server_weight_transfer == "nccl" and config.vllm_group_port == 51216
    assert config.vllm_server_weights_dir is None and "--vllm_server_weights_dir" not in training
    assert not (ROOT / ".vllm_weights").exists()  # the old default, on the shared file system
    assert script_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"  # the server's model, from the YAML
    assert config.output_dir == str(tmp / "out")
    assert config.resume_from_checkpoint is True  # resumes by itself
    assert config.fault_timeout == 120 and config.ddp_timeout == 1800  # a dead peer: the heartbeat, not a collective
    script_args, config = recipe.parse_args([*recipe_argv, "--bf16", "false", "--resume_from_checkpoint", "false"])
    assert config.resume_from_checkpoint is None  # the user's own choice comes after, and wins


def test_weights_as_files_need_a_shared_directory_named(rendered, tmp_path, monkeypatch):
    """WEIGHT_TRANSFER=files without VLLM_WEIGHTS_DIR stops before anything starts, saying why; with it, the directory
    is made and reaches GRPOConfig with the files transport."""
    _, env, _ = rendered
    env = {**env, "CALLS": str(tmp_path / "calls.jsonl"), "WEIGHT_TRANSFER": "files", "LOG_DIR": str(tmp_path / "l")}
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "WEIGHT_TRANSFER=files needs VLLM_WEIGHTS_DIR" in done.stderr
    assert not [c for c in records(tmp_path / "calls.jsonl") if "grpo_hf.vllm_serve" in c.get("argv", [])]
    env["VLLM_WEIGHTS_DIR"] = str(tmp_path / "weights")
    done = subprocess.run(["bash", str(SBATCH), "--output_dir", str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    training = steps(records(tmp_path / "calls.jsonl"))[1]["argv"]
    monkeypatch.chdir(ROOT)
    _, config = recipe.parse_args([*training[training.index("recipes/gsm8k.py") + 1 :], "--bf16", "false"])
    assert config.vllm_server_weight_transfer == "files"
    assert config.vllm_server_weights_dir == str(tmp_path / "weights") and (tmp_path / "weights").is_dir()


def test_each_training_node_launches_with_its_own_machine_rank(rendered):
    """train_node.sh, as srun runs it on each training node: --machine_rank is the task's rank, then the rest."""
    calls, env, tmp = rendered
    launch = steps(calls)[1]["argv"]
    launch = launch[launch.index("recipes/slurm/train_node.sh") :]
    os.remove(env["CALLS"])
    for rank in ("0", "1"):
        subprocess.run(["bash", *launch], env={**env, "SLURM_PROCID": rank}, cwd=ROOT, check=True, timeout=30)
    ranks = [json.loads(line)["argv"] for line in Path(env["CALLS"]).read_text().splitlines()]
    assert [argv[:3] for argv in ranks] == [["launch", "--machine_rank", "0"], ["launch", "--machine_rank", "1"]]
    assert all(argv[3:] == launch[1:] for argv in ranks)


def test_fewer_than_two_nodes_is_refused_with_a_message(rendered, tmp_path):
    _, env, tmp = rendered
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp / "bin" / "srun", tmp_path / "bin" / "srun")
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho gpu-a\n")
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    env = {**env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "CALLS": str(tmp_path / "c")}
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "needs at least 2 nodes" in done.stderr
    assert not (tmp_path / "c").exists()  # nothing was started


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_stop_signal_reaches_the_training_then_the_server_stops_and_the_job_requeues(rendered, tmp_path):
    """SLURM's USR1 (--signal=B:USR1@600) to the batch script: the training step gets it, saves and exits with the
    stopped code; only then is the server stopped (a rollout in flight needs it), and the job requeued."""
    _, env, _ = rendered
    calls = tmp_path / "calls.jsonl"
    env = {**env, "CALLS": str(calls), "TRAINING": "until_stopped", "LOG_DIR": str(tmp_path / "logs")}
    job = subprocess.Popen(
        ["bash", str(SBATCH), "--output_dir", str(tmp_path / "out")], env=env, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: any("recipes/slurm/train_node.sh" in r.get("argv", []) for r in records(calls)), "training")
    time.sleep(0.5)  # the fake srun's handler is set
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    done = records(calls)
    stop, server = done.index({"tool": "srun", "signal": "SIGUSR1"}), done.index({"tool": "srun", "server": "SIGTERM"})
    requeue = done.index({"tool": "scontrol", "argv": ["requeue", "4242"]})
    assert stop < server < requeue
    assert f"stopped (exit code {STOPPED_EXIT_CODE}): requeueing job 4242" in err


LAUNCHER = """#!{python}
import json, os, signal, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {worker!r}])
code = worker.wait()
with open(os.environ["CALLS"], "a") as f:  # the launcher outlived the stop, which it ignored
    ignores = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    f.write(json.dumps({{"launcher_ignores": ignores, "worker": code}}) + "\\n")
sys.exit(0 if code == 0 else 1)  # as torchrun's agent: any failure is 1
"""
WORKER = """
import json, os, signal, sys, time
def stop(signum, frame):
    sys.exit({stopped})  # as recipes/gsm8k.py after its checkpoint
signal.signal(signal.SIGUSR1, stop)
open(os.environ["READY"], "w").close()
time.sleep(60)
"""


def test_train_node_passes_a_stop_to_the_training_processes_and_exits_with_the_stopped_code(tmp_path):
    """USR1 to train_node.sh: its launcher (torchrun's agent, which SIGUSR1 would kill) ignores it, the training
    processes get it and exit with the stopped code, and train_node.sh exits with it (the launcher says 1)."""
    (tmp_path / "bin").mkdir()
    launcher = tmp_path / "bin" / "accelerate"
    launcher.write_text(LAUNCHER.format(python=sys.executable, worker=WORKER.format(stopped=STOPPED_EXIT_CODE)))
    launcher.chmod(0o755)
    calls, ready = tmp_path / "calls.jsonl", tmp_path / "ready"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "SLURM_PROCID": "1"}
    env.update(CALLS=str(calls), READY=str(ready))
    node = subprocess.Popen(["bash", str(TRAIN_NODE), "recipes/gsm8k.py"], env=env, stderr=subprocess.PIPE, text=True)
    wait_for(ready.exists, "the training process")
    node.send_signal(signal.SIGUSR1)
    _, err = node.communicate(timeout=60)
    assert node.returncode == STOPPED_EXIT_CODE, err
    assert records(calls) == [{"launcher_ignores": True, "worker": STOPPED_EXIT_CODE}]
    assert "SIGUSR1 on" in err and "finish their step, save and stop" in err
