"""The package's shape (docs/design.md ("Layout")): `trainer.py` stays a table of contents, and imports run one way."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from string import Formatter

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_hf"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, *, type_checking: bool) -> set[str]:
    """The `grpo_hf` modules `path` names in an import statement: at the top and inside functions, and with
    `type_checking` also under `if TYPE_CHECKING:` (without it, what runs). `from grpo_hf.x import y` imports
    `grpo_hf.x.y` when that is a module, else `grpo_hf.x`."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if not type_checking:
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
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            names = submodules if len(submodules) == len(node.names) else {node.module, *submodules}
        elif isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found - {module_name(path)}


IMPORTS = {name: imports_of(path, type_checking=False) for name, path in MODULES.items()}
ALL_IMPORTS = {name: imports_of(path, type_checking=True) for name, path in MODULES.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module: each is a set of modules that import
    each other, directly or through others."""
    order, low, stack, cycles = {}, {}, [], []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if child not in order:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], order[child])
        if low[node] == order[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def function_lengths(path: Path) -> dict[str, int]:
    return {
        f"{path.relative_to(PACKAGE.parent)}:{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_trainer_is_a_table_of_contents():
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= 450


def test_no_function_is_over_60_lines():
    long = {name: n for path in MODULES.values() for name, n in function_lengths(path).items() if n > 60}
    assert long == {}


def test_no_module_imports_a_module_that_imports_it():
    assert import_cycles(ALL_IMPORTS) == []


def test_the_cycle_check_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def private_trainer_uses(source: str) -> list[str]:
    """`trainer._x` / `self.trainer._x` in `source`: a private attribute read or written through a trainer."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "trainer")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "trainer")
        )
    ]


def test_no_module_but_the_trainer_touches_its_private_state():
    found = {
        name: uses
        for name, path in MODULES.items()
        if name != "grpo_hf.trainer" and (uses := private_trainer_uses(path.read_text()))
    }
    assert found == {}
    assert private_trainer_uses("self.trainer._buffer = []\nx = trainer._metrics['train']") == [
        "self.trainer._buffer",
        "trainer._metrics",
    ]


LEAVES = {"grpo_hf.background"}  # the process's event loop for async rewards and tools


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("grpo_hf.core", set()),
        # leaves that any layer may use: `paths` (local path or Hub id, standard library only) and `peft_utils`
        # (the one "PEFT model / base model under PEFT" helper)
        ("grpo_hf.paths", set()),
        ("grpo_hf.peft_utils", set()),
        ("grpo_hf.background", set()),  # the process's event loop for async rewards and tools
        ("grpo_hf.values", set()),  # `as_dict` and `with_article`, for the config and the input checks alike
        # `vision` (a VLM's per-row image inputs, the forward's vision arguments, its image tokens): torch and
        # transformers only, for the rollout engines and the log-prob forwards alike
        ("grpo_hf.vision", set()),
        # `cache_layers` (the kinds of cache layer transformers builds, a prompt's cache repeated to its rows): torch
        # and transformers only, for the rollout engines and the log-prob forwards alike
        ("grpo_hf.cache_layers", set()),
        # `routers` (each MoE family's router: recording and replaying its top-k experts): torch and transformers
        # only, for the rollout engines (recording) and the trainer's replay (`grpo_hf.replay`)
        ("grpo_hf.routers", set()),
        # `offline_model` (the offline SmolLM2's directory, converted once from its PyPI package): torch and
        # transformers only, for the loaders in `models` and for users (`grpo_hf.offline_model_path`)
        ("grpo_hf.offline_model", set()),
        # rewards: reward models (rewards/reward_models.py) check their paths with `paths`
        ("grpo_hf.rewards", {"grpo_hf.rewards", "grpo_hf.paths", *LEAVES}),
        # parallel: collective helpers over accelerate, importing nothing of grpo_hf (checked below); the vLLM
        # server engine stops every process together with its `stop_together`
        ("grpo_hf.parallel", set()),
        (
            "grpo_hf.rollout",
            {
                "grpo_hf.rollout",
                "grpo_hf.core",
                "grpo_hf.parallel",
                "grpo_hf.peft_utils",
                "grpo_hf.background",
                "grpo_hf.vision",
                "grpo_hf.cache_layers",
                "grpo_hf.routers",
            },
        ),
        # log-probs: the forwards (`logprobs`) and the choice among them by device and memory (`forward_plan`)
        (
            "grpo_hf.logprobs",
            {
                "grpo_hf.core",
                "grpo_hf.peft_utils",
                "grpo_hf.vision",
                "grpo_hf.forward_plan",
                "grpo_hf.cache_layers",
            },
        ),
        ("grpo_hf.forward_plan", {"grpo_hf.core", "grpo_hf.vision"}),
        # models: loading and building the policy, the reference and the tokenizer, from the leaves only (no step
        # module: not validation, experience, objective, rollout or rewards); `heads`: the fp32 LM head, the MoE
        # router's loss weight
        (
            "grpo_hf.models",
            {"grpo_hf.paths", "grpo_hf.peft_utils", "grpo_hf.vision", "grpo_hf.values", "grpo_hf.offline_model"},
        ),
        ("grpo_hf.heads", {"grpo_hf.peft_utils"}),
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


PROGRAMS = {  # the modules that run in processes of their own, and what beyond the standard library they import
    "grpo_hf.rewards.sandbox_bootstrap": set(),
    "grpo_hf.rewards.sandbox_runner": set(),  # the sandbox's interpreter may not even have grpo_hf
    "grpo_hf.rewards.sandbox_probe": set(),
    "grpo_hf.rewards.latex_worker": {"math_verify"},
}


@pytest.mark.parametrize(("program", "allowed"), PROGRAMS.items())
def test_programs_import_only_the_standard_library(program, allowed):
    """They start fast, by path, whatever the interpreter has installed: nothing of grpo_hf, torch or the like."""
    tree = ast.parse(MODULES[program].read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in imported} - sys.stdlib_module_names - allowed == set()


TOP = ["grpo_hf.trainer", "grpo_hf.async_trainer"]  # the trainers: AsyncGRPOTrainer is GRPOTrainer under TRL's API


def test_nothing_imports_the_trainer():
    # The package's `__init__` imports them under TYPE_CHECKING only, for the types of its lazy exports; the one
    # subclass, `async_trainer`, imports `trainer` and is imported by nothing.
    importers = {top: sorted(name for name, imported in ALL_IMPORTS.items() if top in imported) for top in TOP}
    assert importers == {"grpo_hf.trainer": ["grpo_hf", "grpo_hf.async_trainer"], "grpo_hf.async_trainer": ["grpo_hf"]}


def test_the_layout_check_sees_imports():
    """The checks above read real import statements: the trainer imports the modules it wires."""
    wired = {"grpo_hf.experience", "grpo_hf.logprobs", "grpo_hf.core", "grpo_hf.checkpoint"}
    assert wired <= IMPORTS["grpo_hf.trainer"]
    assert "grpo_hf.core" in IMPORTS["grpo_hf.logprobs"] and "grpo_hf.trainer" not in IMPORTS["grpo_hf.experience"]


# ---- settings: checked once, when the config is built, and read by the step as frozen objects -----------------------
def reads_of_args(source: str) -> list[str]:
    """Each `args.<name>` attribute read or write (`args` itself or `self.args`) in `source`."""
    return sorted(
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("args", "self.args")
    )


def writes_to_args(source: str) -> list[str]:
    """Each assignment to an attribute of `args` / `self.args` (`args.x.y = ...` too), and `setattr(args, ...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            text = ast.unparse(target)
            if isinstance(target, ast.Attribute) and text.startswith(("args.", "self.args.")):
                found.append(text)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            if ast.unparse(node.args[0]) in ("args", "self.args"):
                found.append(ast.unparse(node))
    return found


def test_config_and_validation_import_nothing_of_each_other():
    assert "grpo_hf.config" not in ALL_IMPORTS["grpo_hf.validation"]
    assert "grpo_hf.validation" not in ALL_IMPORTS["grpo_hf.config"]


@pytest.mark.parametrize("module", ["grpo_hf.objective", "grpo_hf.logprobs", "grpo_hf.forward_plan"])
def test_the_loss_and_the_log_probs_read_frozen_settings_not_the_config(module):
    assert reads_of_args(MODULES[module].read_text()) == []


def test_nothing_edits_the_config_after_it_is_built():
    edits = {
        name: found
        for name, path in MODULES.items()
        if name not in ("grpo_hf.config", "grpo_hf.vllm_config") and (found := writes_to_args(path.read_text()))
    }
    assert edits == {}


def test_the_settings_checks_see_reads_and_edits():
    assert reads_of_args("x = self.args.beta\ny = args.loss_settings()") == ["args.loss_settings", "self.args.beta"]
    source = "args.accelerator_config.dispatch_batches = False\nsetattr(args, 'x', 1)\nself.args.beta += 1"
    assert sorted(writes_to_args(source)) == [
        "args.accelerator_config.dispatch_batches",
        "self.args.beta",
        "setattr(args, 'x', 1)",
    ]


def reads_as_a_program(text: str) -> bool:
    """Whether `text` is Python with an import, a def or a class in it: a program, not a message or an expression.
    A template's `{fields}` (str.format) are read as names first."""
    variants = [text]
    try:
        variants.append(
            "".join(literal + ("_" if field is not None else "") for literal, field, _, _ in Formatter().parse(text))
        )
    except ValueError:  # not a valid template
        pass
    for variant in variants:
        try:
            tree = ast.parse(variant)
        except (SyntaxError, ValueError):
            continue
        if any(
            isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef) for node in ast.walk(tree)
        ):
            return True
    return False


def programs_in_strings(source: str) -> list[int]:
    """The lines of `source` where a string constant or an f-string holds a program (`reads_as_a_program`; an
    f-string's replacement fields read as names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(part.value if isinstance(part, ast.Constant) else "_" for part in node.values)
        else:
            continue
        if reads_as_a_program(text):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_holds_a_program_in_a_string():
    """A program is a module of its own (rewards/sandbox_runner.py, ...), so the linter and the tests read it."""
    found = {name: lines for name, path in MODULES.items() if (lines := programs_in_strings(path.read_text()))}
    assert found == {}


def test_the_program_check_finds_programs():
    assert programs_in_strings('RUNNER = """import os, sys\n\ndef run():\n    pass\n"""') == [1]
    assert programs_in_strings("PROBE = '''\nimport os\nassert os.getpid() == {pid!r}\n'''") == [1]
    assert programs_in_strings("script = f'import json; print(json.dumps({value!r}))'") == [1]
    assert programs_in_strings("x = 'import os'") == [1]
    messages = "a = 'pass the tokenizer itself: AutoTokenizer.from_pretrained(path)'\nb = 'x + 1'\nc = '{n} rows'"
    assert programs_in_strings(messages) == []
