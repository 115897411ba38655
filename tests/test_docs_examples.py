"""Every Python block of README.md and docs/*.md runs as written, offline, on a tiny model.

A block runs unless the last non-blank line before it is `<!-- not-run: reason -->` (tests/test_readme.py reads the
blocks and checks the markers), so a new example runs by default. Each runs in a fresh namespace, in a temporary
working directory, with the Hub offline and only two kinds of change:

- **model ids**: each Hub id the block quotes, and the offline model (`offline_model_path()`, or its alias
  quoted), is replaced by a local tiny model of the same kind (`MODEL_IDS`): a byte-level tokenizer with TRL's
  Qwen2.5 chat template (which renders tools) for the text models, an Idefics3 and its processor for the
  vision-language one. A quoted "org/name" that is not in `MODEL_IDS` fails the test (it would go to the network), and
  so does a call of `offline_model_path` with arguments (it would convert the real model);
- **sizes**: every `GRPOConfig(...)` the block builds gets `SIZES` and `CPU_RUN` over its own values: one step of
  one group of 2 completions of a few tokens on the CPU, no prompt truncation (the byte-level tokenizer spends a
  token per byte, about four times a real one's count), nothing saved or reported.

Everything else (datasets, rewards, tools, environments, the trainer's arguments) is the block's own.

A block whose import says `# was: from trl import ...` claims that a TRL script ports by changing the import: it
also runs on TRL 1.16 with the import changed back and the lines marked `# grpo_hf's own` left out (TRL has no
such setting), on the same tiny models and sizes (TRL has no `max_prompt_length`; `bf16=False`, on the CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub.constants
import pytest
import trl
from conftest import build_tiny_model, build_tiny_tokenizer
from test_readme import DOCUMENTS, python_blocks
from tiny_vlm import tiny_idefics3

from grpo_hf import GRPOTrainer
from grpo_hf.offline_model import OFFLINE_MODEL_ID

QWEN_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()

MODEL_IDS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "text",
    "Qwen/Qwen2.5-VL-3B-Instruct": "vision",
    OFFLINE_MODEL_ID: "text",  # SmolLM2-135M-Instruct
}
"""The Hub ids the examples name -> which tiny model stands in for them."""

SIZES = dict(
    max_steps=1,
    per_device_train_batch_size=2,
    num_generations=2,
    max_completion_length=8,
    max_prompt_length=None,
)
CPU_RUN = dict(use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)

HUB_ID = re.compile(r"""(["'])((?:[A-Za-z][\w.-]*/|offline:)[A-Za-z][\w.-]*)\1""")  # "org/name", the offline alias
OFFLINE_CALL = re.compile(r"(?<![\w.])offline_model_path\(\)")  # the offline model's directory
CONFIG_CALL = re.compile(r"(?<![\w.])GRPOConfig\(")

EXAMPLES = [(name, code) for document in DOCUMENTS for name, code, reason in python_blocks(document) if not reason]
TRL_IMPORT = re.compile(r"^from grpo_hf import (.+?)  # was: (from trl import .+)$", re.M)
OWN_SETTING = re.compile(r"^.*# grpo_hf's own\b.*\n", re.M)
TRL_EXAMPLES = [(name, code) for name, code in EXAMPLES if TRL_IMPORT.search(code)]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """{"text": directory, "vision": directory} of tiny models saved with `save_pretrained`, as a Hub id's files."""
    root = tmp_path_factory.mktemp("docs_models")
    tokenizer = build_tiny_tokenizer(chat_template=QWEN_TEMPLATE)
    model = build_tiny_model(tokenizer, "qwen2")
    model.save_pretrained(root / "text")
    tokenizer.save_pretrained(root / "text")
    vision_model, processor = tiny_idefics3()
    vision_model.save_pretrained(root / "vision")
    processor.save_pretrained(root / "vision")
    return {"text": str(root / "text"), "vision": str(root / "vision")}


def with_tiny_models(code: str, name: str, directories: dict[str, str]) -> str:
    """`code` with each quoted Hub id, and each `offline_model_path()`, replaced by its tiny model's directory."""

    def local(match: re.Match) -> str:
        hub_id = match[2]
        if hub_id not in MODEL_IDS:
            pytest.fail(
                f"{name} quotes {hub_id!r}, a Hub id that is not in MODEL_IDS: map it to a tiny model there (a local "
                f"path: write it as './{hub_id}')"
            )
        return repr(directories[MODEL_IDS[hub_id]])

    code = OFFLINE_CALL.sub(repr(directories[MODEL_IDS[OFFLINE_MODEL_ID]]), code)
    if "offline_model_path(" in code:
        pytest.fail(
            f"{name} calls offline_model_path with arguments: call it as offline_model_path(), which is replaced"
        )
    return HUB_ID.sub(local, code)


def sized(config_class, sizes=SIZES):
    """`GRPOConfig(...)` (the class the block imported) -> that call with `SIZES` and `CPU_RUN` over its values,
    once the block's own values have passed the config's checks (divisibility of the batch by the group, ...)."""

    def build(*args, **kwargs):
        config_class(*args, **{**kwargs, **CPU_RUN})
        return config_class(*args, **{**kwargs, **sizes, **CPU_RUN})

    return build


def test_the_examples_are_found():
    names = [name for name, _ in EXAMPLES]
    assert any(name.startswith("README.md") for name in names)
    assert sum(name.startswith("docs/tools.md") for name in names) == 2


def test_the_first_examples_name_the_offline_model():
    """The README's Python example and the tools examples run as written after `make install`, offline: they train the
    offline model, not a Hub id (which they may name in a comment, for a GPU)."""
    first = [code for name, code in EXAMPLES if name.startswith(("README.md", "docs/tools.md"))]
    assert len(first) == 3
    for code in first:
        code_only = "\n".join(line.split("#")[0] for line in code.splitlines())
        assert OFFLINE_CALL.search(code_only) and not HUB_ID.search(code_only)


def test_model_ids_are_replaced_and_unknown_ones_fail():
    directories = {"text": "/tiny/text", "vision": "/tiny/vision"}
    code = f'a = offline_model_path()\nb = "{OFFLINE_MODEL_ID}"\nc = "Qwen/Qwen2.5-VL-3B-Instruct"'
    assert with_tiny_models(code, "x", directories) == "a = '/tiny/text'\nb = '/tiny/text'\nc = '/tiny/vision'"
    for code in ('GRPOTrainer(model="someone/some-model")', 'offline_model_path(cache_dir="cache")'):
        with pytest.raises(pytest.fail.Exception):
            with_tiny_models(code, "x", directories)


def run_example(name: str, code: str, directories: dict[str, str], trainer_class, sizes: dict) -> None:
    """Run `code` with the tiny models and `sizes`; the trainers it trains (`.train()`) must have taken their step."""
    source = CONFIG_CALL.sub("_sized(GRPOConfig)(", with_tiny_models(code, name, directories))
    namespace = {"__name__": "__main__", "_sized": lambda config_class: sized(config_class, sizes)}
    exec(compile(source, name, "exec"), namespace)
    if ".train()" in code:
        trainers = [value for value in namespace.values() if isinstance(value, trainer_class)]
        assert trainers and all(trainer.state.global_step == sizes["max_steps"] for trainer in trainers), name


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_the_example_runs(name, code, tiny_models, offline):
    run_example(name, code, tiny_models, GRPOTrainer, SIZES)


@pytest.mark.parametrize(("name", "code"), TRL_EXAMPLES, ids=[name for name, _ in TRL_EXAMPLES])
def test_the_example_runs_on_trl_with_the_import_changed_back(name, code, tiny_models, offline, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_code = OWN_SETTING.sub("", TRL_IMPORT.sub(r"\2", code))
    assert "grpo_hf" not in trl_code, f"{name} uses grpo_hf beyond its import: mark those lines # grpo_hf's own"
    sizes = {key: value for key, value in SIZES.items() if key != "max_prompt_length"} | {"bf16": False}
    run_example(name, trl_code, tiny_models, trl.GRPOTrainer, sizes)
