"""The README and docs/ stay true: the commands, paths and names they cite exist, their links resolve, the config
reference is the generated one, and each row of the formula -> code map is found in the function it names."""

import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import grpo_hf
from grpo_hf.config import config_reference_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES]
README_MAX_LINES = 250

FENCED = re.compile(r"^```.*?^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _code(text: str) -> list[str]:
    """Every fenced block and every inline code span of a markdown text: where commands, paths and names are cited."""
    blocks = FENCED.findall(text)
    return blocks + INLINE.findall(FENCED.sub("", text))


def _prose(text: str) -> str:
    """The text without code, so that brackets inside code are not read as links, nor `#` comments as headings."""
    return INLINE.sub("", FENCED.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (word characters, '-' and ' ' kept), spaces -> '-';
    a repeated heading gets -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def _resolve(dotted: str):
    """`grpo_hf.core.grpo_loss` or `grpo_hf.core.EntropyControl.step` -> the object: import the longest module prefix,
    then getattr the rest (AttributeError when a name is gone)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


# ---- the README ----------------------------------------------------------------------------------------------------


def test_the_readme_is_a_front_door():
    lines = _read(README).splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_two_setup_commands_are_documented_and_wired():
    readme = _read(README)
    assert "make demo" in readme and "make test" in readme
    makefile = _read(ROOT / "Makefile")
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in _read(ROOT / ".ci" / "run")


def test_make_test_reruns_the_kernel_path_tests_under_the_other_cpu_kernels():
    """`make test` calls tests/kernel_paths.py, which finds marked tests (no empty rerun: pytest's exit 5) and reruns
    them under each kernel set this CPU runs but the first run's; `avx2` only on CPUs that have it."""
    import kernel_paths

    test_recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", _read(ROOT / "Makefile"), re.M).group(1)
    assert "tests/kernel_paths.py" in test_recipe
    assert '"kernel_paths:' in _read(ROOT / "pyproject.toml")  # registered, so pytest knows it
    assert {Path(m).name for m in kernel_paths.marked_modules()} >= {"test_logprobs.py", "test_vision.py"}
    assert kernel_paths.reruns("avx512", "avx512") == ["default", "avx2"]
    assert kernel_paths.reruns("avx2", "avx2") == ["default"]
    assert kernel_paths.reruns("avx512", "default") == ["avx2"]
    assert kernel_paths.reruns("sve256", "sve256") == ["default"]


def test_the_step_diagram_is_the_trainers():
    """The README's step diagram is the one at the top of grpo_hf/trainer.py, line for line."""
    doc = inspect.getdoc(importlib.import_module("grpo_hf.trainer"))
    match = re.search(r"::\n\n(.+?)(?:\n\n|\Z)", doc, re.S)
    assert match, "grpo_hf/trainer.py's docstring lost its step diagram (a '::' block)"
    trainer_diagram = textwrap.dedent(match.group(1)).strip()
    section = _read(README).split("## One training step", 1)[1]
    readme_diagram = re.search(r"```\n(.+?)\n```", section, re.S).group(1).strip()
    assert readme_diagram == trainer_diagram, "copy the diagram at the top of grpo_hf/trainer.py into the README"


def test_public_names_exist():
    for name in grpo_hf.__all__:
        assert getattr(grpo_hf, name) is not None


# ---- docs/ ---------------------------------------------------------------------------------------------------------


def test_config_reference_is_generated_from_the_field_help():
    assert config_reference_markdown() in _read(ROOT / "docs" / "config.md"), (
        "regenerate it: python -m grpo_hf.config, and paste the table into docs/config.md"
    )


def _formula_rows() -> list[tuple[str, str]]:
    """(dotted function name, quoted code) for each row of the formula -> code table in docs/losses.md."""
    section = _read(ROOT / "docs" / "losses.md").split("## Formula → code", 1)[1]
    table = [line for line in section.splitlines() if line.startswith("|")][2:]  # [2:]: header and separator
    rows = [re.fullmatch(r"\| .+? \| `(grpo_hf\.[\w.]+)` \| `([^`]+)` \|", line) for line in table]
    assert all(rows), f"rows not in the form '| formula | `grpo_hf.module.function` | `code` |': {table}"
    return [row.groups() for row in rows]


def test_formula_map_names_the_function_that_computes_each_formula():
    """Each row's dotted name resolves (import + getattr) and the quoted expression is in that function's source."""
    rows = _formula_rows()
    assert len(rows) >= 15
    for dotted, code in rows:
        obj = _resolve(dotted)
        obj = obj.fget if isinstance(obj, property) else obj
        assert code in inspect.getsource(obj), f"docs/losses.md says {dotted} computes `{code}`"


def test_every_docs_page_is_linked_and_every_link_resolves():
    """Relative links (README <-> docs/, docs/ <-> docs/) point at files in the repository, and at headings that
    exist; every docs/ page is linked from some other page."""
    linked: set[Path] = set()
    for document in DOCUMENTS:
        for target in LINK.findall(_prose(_read(document))):
            if re.match(r"[a-z]+:", target):  # http(s), mailto
                continue
            path_part, _, anchor = target.partition("#")
            path = (document.parent / path_part).resolve() if path_part else document
            where = f"{_name(document)} links {target}"
            assert path.is_relative_to(ROOT), f"{where}, outside the repository"
            assert path.exists(), f"{where}, which does not exist"
            if path != document:
                linked.add(path)
            if anchor:
                assert path.suffix == ".md" and anchor in _anchors(_read(path)), f"{where}: no such heading"
    for page in PAGES:
        assert page.resolve() in linked, f"no page links {_name(page)}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_cited_paths_names_and_commands_exist(document):
    """The repository paths, `grpo_hf.*` names, `python -m` modules and `make` targets a page cites exist."""
    code = "\n".join(_code(_read(document)))
    for path in set(re.findall(r"(?<![\w./-])((?:grpo_hf|tests|recipes|benchmarks|docs|\.ci)/[\w./*-]*)", code)):
        path = path.rstrip(".") if not path.endswith(".*") else path
        assert list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists(), f"{_name(document)} cites {path}"
    for module in set(re.findall(r"python -m (grpo_hf[\w.]*)", code)):
        assert importlib.util.find_spec(module), f"{_name(document)} runs python -m {module}, which does not exist"
    for dotted in set(re.findall(r"(?<![\w.])(grpo_hf(?:\.\w+)+)", FENCED.sub("", code))):
        try:
            _resolve(dotted)
        except (AttributeError, ModuleNotFoundError) as error:
            pytest.fail(f"{_name(document)} cites {dotted}: {error!r}")
    for module, names in re.findall(r"^from (grpo_hf[\w.]*) import ([\w, ]+)$", code, re.M):
        for name in names.replace(" ", "").split(","):
            assert hasattr(_resolve(module), name), f"{_name(document)} imports {name} from {module}"
    targets = set(re.findall(r"^([\w-]+):", _read(ROOT / "Makefile"), re.M))
    for target in set(re.findall(r"\bmake ([a-z][\w-]*)", code)):
        assert target in targets, f"{_name(document)} cites make {target}, which the Makefile does not define"


BENCHMARK_COMMAND = re.compile(r"benchmarks/(\w+\.(?:py|sh))([^#`|]*)")


def _benchmark_configs() -> list[str]:
    """The config names `benchmarks/_worker.py` defines (`CONFIGS`, some built by a comprehension)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_worker", ROOT / "benchmarks" / "_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CONFIGS)


@pytest.mark.parametrize(
    "document", [*DOCUMENTS, ROOT / "Makefile", ROOT / "benchmarks" / "gpu_first_run.sh"], ids=_name
)
def test_cited_benchmark_commands_take_their_flags_and_configs(document):
    """Every benchmark command a page cites names flags its script defines (and `--configs` / `--config` it has), so
    that each quoted figure names a command that still runs."""
    text = _read(document).replace("\\\n", " ")  # shell continuation lines
    pieces = [line for block in (_code(text) if document.suffix == ".md" else [text]) for line in block.splitlines()]
    configs = set(_benchmark_configs())
    for piece in pieces:
        for script, rest in BENCHMARK_COMMAND.findall(piece):
            source = _read(ROOT / "benchmarks" / script)
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                assert f'"{flag}"' in source, (
                    f"{_name(document)} runs benchmarks/{script} {flag}, which it does not take"
                )
            for names in (
                re.findall(r"--configs? ([\w,-]+)", rest)
                if script == "vs_trl.py" or script == "profile_step.py"
                else []
            ):
                assert set(names.split(",")) <= configs, (
                    f"{_name(document)}: benchmarks/{script} has no config {names}"
                )


PYTHON_TAGS = ("python", "py", "python3")
BLOCK = re.compile(r"^```(?P<tag>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not-run: (?P<reason>.*?) -->")


def python_blocks(document: Path) -> list[tuple[str, str, str | None]]:
    """(name, code, reason) for each Python block of a page: name "docs/x.md, python block N" (N from 1), reason the
    text of a `<!-- not-run: reason -->` comment on the last non-blank line before the block, else None (the block
    runs: tests/test_docs_examples.py). Blocks tagged python, py or python3 are Python; other blocks never run."""
    text, blocks = _read(document), []
    for block in BLOCK.finditer(text):
        if block["tag"].strip() not in PYTHON_TAGS:
            continue
        line_before = text[: block.start()].rstrip("\n").rpartition("\n")[2]
        marker = NOT_RUN.fullmatch(line_before.strip())
        name = f"{_name(document)}, python block {len(blocks) + 1}"
        blocks.append((name, block["code"], marker["reason"].strip() if marker else None))
    return blocks


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_python_examples_compile(document):
    for name, code, _ in python_blocks(document):
        compile(code, name, "exec")


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_each_not_run_marker_gives_a_reason_and_marks_a_python_block(document):
    """`<!-- not-run: reason -->` is the only way to keep a Python block from running, so each one must sit on the
    line just before a Python block and say why; a misplaced marker would mark nothing and leave its block running."""
    marked = sum(reason is not None for _, _, reason in python_blocks(document))
    markers = re.findall(r"<!--\s*not[-_ ]?run\b.*?-->", _prose(_read(document)), re.S)  # not those quoted in code
    for marker in markers:
        match = NOT_RUN.fullmatch(marker)
        assert match and match["reason"].strip(), f"{_name(document)}: write {marker!r} as <!-- not-run: reason -->"
    assert marked == len(markers), (
        f"{_name(document)} has {len(markers)} not-run markers but {marked} mark a Python block: put each on the "
        "line just before the ```python line"
    )


def test_nothing_refers_to_a_file_outside_the_repository():
    """The design notes ship in docs/; no file points at a document kept outside the repository."""
    outside = ("../" + "shared", "DESIGN" + ".md")
    files = [README, ROOT / "Makefile", ROOT / "pyproject.toml", *(ROOT / ".ci").iterdir()]
    for folder in ("grpo_hf", "tests", "recipes", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".yml", ".sh", ".toml"}]
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for needle in outside:
            assert needle not in text, f"{_name(path)} refers to {needle}, outside the repository"
