"""recipes/slurm/grpo.sbatch on a fake 3-node allocation: `scontrol`, `srun`, `curl` and `accelerate` are stand-ins
on PATH that record their arguments, so the commands the script would run are checked without SLURM or GPUs; the
training command's recipe arguments are parsed by the recipe's own parser, into the `GRPOConfig` it trains with."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "recipes" / "slurm" / "grpo.sbatch"
NODES = ("gpu-a", "gpu-b", "gpu-c")
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:]}}) + "\\n")
"""

recipe = load_recipe("gsm8k")


def fake_tools(bin_dir: Path) -> None:
    """`scontrol show hostnames` prints NODES; `srun`, `curl` (the server answers at once) and `accelerate` record
    their arguments in $CALLS and succeed."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + "".join(f"echo {node}\n" for node in NODES))
    for tool in ("srun", "curl", "accelerate"):
        (bin_dir / tool).write_text(RECORDER.format(python=sys.executable))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Every command the script runs in a job of 3 nodes, 8 GPUs each, submitted from the repository."""
    tmp = tmp_path_factory.mktemp("slurm")
    fake_tools(tmp / "bin")
    calls = tmp / "calls.jsonl"
    env = {
        **os.environ,
        "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(calls),
        "MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "VLLM_WEIGHTS_DIR": str(tmp / "weights"),
    }
    args = ["--config", "recipes/gsm8k_vllm.yaml", "--output_dir", str(tmp / "out")]
    done = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()], env, tmp


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_last_node_serves_the_first_trains_as_main(rendered):
    calls, _, _ = rendered
    (health,) = [call for call in calls if call["tool"] == "curl"]  # the server's srun runs in the background
    server, training = [call for call in calls if call["tool"] == "srun"]
    assert server["tool"] == "srun" and "--nodelist=gpu-c" in server["argv"] and "--nodes=1" in server["argv"]
    serve = server["argv"][server["argv"].index("python") :]
    assert serve[:3] == ["python", "-m", "grpo_hf.vllm_serve"]
    assert flag(serve, "--model") == "Qwen/Qwen2.5-0.5B-Instruct" and flag(serve, "--host") == "gpu-c"
    assert flag(serve, "--port") == "8000"
    assert health == {"tool": "curl", "argv": ["-sf", "http://gpu-c:8000/health"]}
    assert training["tool"] == "srun"
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu-a,gpu-b"} <= set(training["argv"])
    launch = training["argv"][training["argv"].index("recipes/slurm/train_node.sh") + 1 :]
    assert flag(launch, "--main_process_ip") == "gpu-a" and flag(launch, "--num_machines") == "2"
    assert flag(launch, "--num_processes") == "16" and flag(launch, "--config_file") == "recipes/accelerate/ddp.yaml"


def test_the_server_address_reaches_grpo_config(rendered, monkeypatch):
    """The recipe's parser reads the rendered training command: the server's URL, server mode, and the weights
    directory on the shared file system land in GRPOConfig, over the YAML's colocate mode."""
    calls, _, tmp = rendered
    training = calls[-1]["argv"]
    recipe_argv = training[training.index("recipes/gsm8k.py") + 1 :]
    monkeypatch.chdir(ROOT)  # the command's paths are relative to the submit directory
    script_args, config = recipe.parse_args([*recipe_argv, "--bf16", "false"])  # the YAML's bf16 needs a GPU here
    assert config.use_vllm and config.vllm_mode == "server"
    assert config.vllm_server_base_url == "http://gpu-c:8000"
    assert config.vllm_server_weights_dir == str(tmp / "weights") and (tmp / "weights").is_dir()
    assert script_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"  # the server's model, from the YAML
    assert config.output_dir == str(tmp / "out")


def test_each_training_node_launches_with_its_own_machine_rank(rendered):
    """train_node.sh, as srun runs it on each training node: --machine_rank is the task's rank, then the rest."""
    calls, env, tmp = rendered
    launch = calls[-1]["argv"][calls[-1]["argv"].index("recipes/slurm/train_node.sh") :]
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
