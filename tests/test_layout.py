"""The package's shape (docs/design.md ("Layout")): `trainer.py` stays a table of contents, and imports run one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_hf"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """The `grpo_hf` modules `path` imports when it runs: `if TYPE_CHECKING:` blocks left out."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "grpo_hf")
    return found


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = {name: {m for m in runtime_imports(path) if m in MODULES} for name, path in MODULES.items()}


def test_trainer_is_a_table_of_contents():
    source = (PACKAGE / "trainer.py").read_text()
    assert len(source.splitlines()) <= 600
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("grpo_hf.core", set()),
        # leaves that any layer may use: `paths` (local path or Hub id, standard library only) and `peft_utils`
        # (the one "PEFT model / base model under PEFT" helper)
        ("grpo_hf.paths", set()),
        ("grpo_hf.peft_utils", set()),
        # rewards: reward models (rewards/models.py) check their paths with `paths`
        ("grpo_hf.rewards", {"grpo_hf.rewards", "grpo_hf.paths"}),
        # parallel: collective helpers over accelerate, importing nothing of grpo_hf (checked below); the vLLM
        # server engine stops every process together with its `stop_together`
        ("grpo_hf.parallel", set()),
        ("grpo_hf.rollout", {"grpo_hf.rollout", "grpo_hf.core", "grpo_hf.parallel", "grpo_hf.peft_utils"}),
        ("grpo_hf.logprobs", {"grpo_hf.core", "grpo_hf.peft_utils"}),
    ],
)
def test_lower_layers_import_only_what_is_below_them(layer, allowed):
    outside = {
        f"{name} imports {imported}"
        for name, imported_modules in IMPORTS.items()
        if name == layer or name.startswith(layer + ".")
        for imported in imported_modules
        if not any(imported == a or imported.startswith(a + ".") for a in allowed | {layer})
    }
    assert outside == set()


def test_nothing_imports_the_trainer():
    # The package's `__init__` names it for its lazy attribute lookup only (a string, not an import).
    assert [name for name, imported in IMPORTS.items() if "grpo_hf.trainer" in imported] == []


def test_the_layout_check_sees_imports():
    """The checks above read real import statements: the trainer imports the modules it wires."""
    wired = {"grpo_hf.experience", "grpo_hf.logprobs", "grpo_hf.core", "grpo_hf.checkpoint"}
    assert wired <= IMPORTS["grpo_hf.trainer"]
    assert "grpo_hf.core" in IMPORTS["grpo_hf.logprobs"] and "grpo_hf.trainer" not in IMPORTS["grpo_hf.experience"]
