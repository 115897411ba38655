"""recipes/gsm8k.py: argument parsing (YAML + command line), the errors a new user meets, and short runs."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from conftest import build_tiny_model, build_tiny_tokenizer, load_recipe
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


recipe = load_recipe("gsm8k")


def length_reward(completions, **kwargs):
    """A reward that varies within a group on a random model (accuracy and format are all 0 there)."""
    return [len(c[0]["content"]) / 10 for c in completions]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(recipe, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------


def test_yaml_sets_defaults_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model_name_or_path: some/model\n"
        "learning_rate: 1e-5\n"  # YAML 1.1 reads this as a string; it must still become a float
        "num_generations: 4\n"
        "per_device_train_batch_size: 8\n"
        "reward_funcs: [accuracy, format_gsm8k]\n"
        "reward_weights: [1.0, 0.5]\n"
        "use_peft: true\n"
        "lora_target_modules: [q_proj, v_proj]\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    args, cfg = recipe.parse_args(["--config", str(config)])
    assert args.model_name_or_path == "some/model" and args.use_peft
    assert args.reward_funcs == ["accuracy", "format_gsm8k"] and args.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.num_generations == 4 and cfg.reward_weights == [1.0, 0.5]
    assert cfg.output_dir == str(tmp_path / "out")

    args, cfg = recipe.parse_args(
        ["--learning_rate", "3e-6", "--config", str(config), "--use_peft", "false", "--reward_funcs", "accuracy"]
    )
    assert cfg.learning_rate == 3e-6 and not args.use_peft and args.reward_funcs == ["accuracy"]
    assert cfg.num_generations == 4  # not overridden: from the file


def test_default_rewards_follow_the_answer_format():
    args, _ = recipe.parse_args(["--answer_format", "tags"])
    assert args.reward_funcs == ["accuracy", "format"]
    args, _ = recipe.parse_args([])
    assert args.reward_funcs == ["accuracy", "format_gsm8k"]
    with pytest.raises(ValueError, match="answer_format"):
        recipe.parse_args(["--answer_format", "boxed"])


def test_unknown_yaml_key_is_named(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-5\nnum_generation: 4\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_generation'\]"):
        recipe.parse_args(["--config", str(config)])


def test_unknown_reward_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown reward function 'acuracy'") as err:
        recipe.parse_args(["--reward_funcs", "acuracy", "format_gsm8k"])
    assert "accuracy" in str(err.value) and "format_gsm8k" in str(err.value)


def test_bf16_without_support_says_what_to_do(no_gpu):
    with pytest.raises(ValueError) as err:
        recipe.parse_args(["--config", str(ROOT / "recipes" / "gsm8k.yaml")])  # the GPU recipe asks for bf16
    message = str(err.value)
    assert "bf16=True" in message and "--bf16 false" in message and "recipes/gsm8k_cpu.yaml" in message
    with pytest.raises(ValueError, match="fp16=True .* needs a GPU"):
        recipe.parse_args(["--fp16", "true"])
    _, cfg = recipe.parse_args(["--bf16", "true", "--use_cpu", "true"])  # CPU autocast is allowed
    assert cfg.bf16 and cfg.use_cpu


def test_accelerate_configs_are_valid():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = {p.stem: load_config_from_file(str(p)) for p in (ROOT / "recipes" / "accelerate").glob("*.yaml")}
    assert set(configs) == {"ddp", "fsdp", "zero2", "zero3", "cpu_multiprocess"}
    assert configs["cpu_multiprocess"].num_processes == 2 and configs["cpu_multiprocess"].use_cpu
    assert configs["fsdp"].fsdp_config["fsdp_version"] == 2
    assert configs["zero3"].deepspeed_config["zero_stage"] == 3


def test_shipped_configs_parse(monkeypatch):
    args, cfg = recipe.parse_args(["--config", str(ROOT / "recipes" / "gsm8k_cpu.yaml")])
    assert args.model_name_or_path == "offline:SmolLM2-135M-Instruct"
    assert args.dataset_name == "builtin:arithmetic" and not cfg.bf16
    monkeypatch.setattr(recipe, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    args, cfg = recipe.parse_args(["--config", str(ROOT / "recipes" / "gsm8k.yaml")])
    assert args.model_name_or_path.startswith("Qwen/") and args.dataset_name == "openai/gsm8k" and cfg.bf16


def test_the_library_needs_neither_the_recipe_support_nor_the_recipes_extra():
    """The recipe's own code (recipes/gsm8k_support) and its extra (matplotlib, pyyaml) stay out of grpo_hf: no module
    of the package imports them, and the package's hard dependencies leave the extra's packages out."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    hard = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M).group(1)
    assert "matplotlib" not in hard and "pyyaml" not in hard
    assert re.search(r'^recipes = \[.*"matplotlib.*\]', pyproject, re.M)
    imported = set()
    for path in (ROOT / "grpo_hf").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert "torch" in imported  # the walk sees imports
    assert imported & {"matplotlib", "yaml", "gsm8k_support"} == set()


# ------------------------------------------------------------------------------------------------
# Runs on a tiny model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, "qwen2").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _argv(model_dir, output_dir, *extra):
    return [
        "--model_name_or_path", str(model_dir),
        "--dataset_name", "builtin:arithmetic",
        "--system_prompt", "Solve.",
        "--num_train_examples", "4",
        "--num_eval_examples", "3",
        "--eval_batch_size", "2",
        "--max_steps", "2",
        "--per_device_train_batch_size", "4",
        "--num_generations", "2",
        "--max_completion_length", "8",
        "--learning_rate", "1e-2",
        "--output_dir", str(output_dir),
        "--use_cpu", "true",
        "--report_to", "none",
        "--save_strategy", "no",
        "--disable_tqdm", "true",
        *extra,
    ]  # fmt: skip


def test_recipe_runs_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rewards = ["--reward_funcs", "accuracy", "format_gsm8k", f"{__name__}:length_reward"]
    results = recipe.main(_argv(tiny_model_dir, out, *rewards))

    report = json.loads((out / "eval.json").read_text())
    for stage in ("before", "after"):
        assert report[stage]["n"] == 3 and 0.0 <= report[stage]["accuracy"] <= 1.0
        assert report[stage]["accuracy"] == results[stage]["accuracy"]
    assert report["train_runtime_s"] > 0
    assert len((out / "eval_samples.jsonl").read_text().splitlines()) == 6
    assert (out / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "before" in table and "after" in table and "accuracy" in table

    # The trained model and its tokenizer are saved, and training moved the weights.
    saved = load_file(out / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert saved.keys() == initial.keys()
    assert any(not torch.equal(saved[k], initial[k]) for k in saved)
    assert (out / "tokenizer_config.json").exists() and (out / "config.json").exists()


def test_recipe_with_lora_saves_adapter_and_merged_model(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    extra = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--merge_adapter", "true"]
    no_eval = ["--eval_before", "false", "--eval_after", "false"]
    recipe.main(_argv(tiny_model_dir, out, *no_eval, "--reward_funcs", f"{__name__}:length_reward", *extra))
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    report = json.loads((out / "eval.json").read_text())
    assert "before" not in report and "after" not in report
    merged = load_file(out / "merged" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert merged.keys() == initial.keys()  # a plain model: no LoRA tensors left
    changed = {k for k in merged if not torch.equal(merged[k], initial[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    assert (out / "merged" / "tokenizer_config.json").exists()


def test_eval_only(tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    results = recipe.main(_argv(tiny_model_dir, out, "--eval_only", "true"))
    assert set(results) == {"eval"}
    report = json.loads((out / "eval.json").read_text())
    assert report["eval"]["n"] == 3 and not (out / "model.safetensors").exists()


def test_unreachable_dataset_hub_names_the_offline_config(tiny_model_dir, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    argv = _argv(tiny_model_dir, tmp_path / "out")
    argv[argv.index("builtin:arithmetic")] = "openai/gsm8k"
    with pytest.raises(ConnectionError) as err:
        recipe.main(argv)
    assert "recipes/gsm8k_cpu.yaml" in str(err.value) and "--dataset_path" in str(err.value)


def test_recipe_under_accelerate_launch_on_two_cpu_processes(tiny_model_dir, tmp_path):
    """recipes/accelerate/cpu_multiprocess.yaml: two gloo processes train, and evaluation is split and gathered."""
    out = tmp_path / "dist"
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]  # grpo_hf, and this module's reward
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file"]
    launch.append(str(ROOT / "recipes" / "accelerate" / "cpu_multiprocess.yaml"))
    argv = _argv(tiny_model_dir, out, "--num_eval_examples", "5", "--reward_funcs", f"{__name__}:length_reward")
    argv[argv.index("--use_cpu") + 1] = "true"
    proc = subprocess.run(
        [*launch, str(ROOT / "recipes" / "gsm8k.py"), *argv], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["before"]["n"] == report["after"]["n"] == 5  # 3 + 3 rows, the padded repeat dropped
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted(s["index"] for s in samples if s["stage"] == "after") == [0, 1, 2, 3, 4]
    assert (out / "model.safetensors").exists() and (out / "training_curves.png").exists()
