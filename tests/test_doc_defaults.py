"""What the docs say a config field's default is, checked against the field's real default.

The README and docs/*.md state defaults in a few phrasings (`PROSE`, `SHARED_WITH_TRL`, `CODE_COMMENTS`, and tables
whose columns are "field" then "default" or "grpo_hf"); each statement found about a config field, with a literal
value, is compared with `GRPOConfig`'s default (under a heading naming TRL's AsyncGRPOTrainer, `AsyncGRPOConfig`'s), as
declared or as a default-built config holds it (a dict field declared None is `{}` there). What TRL's default is
("TRL's default") is not checked here (tests/test_trl_dropin.py reads TRL itself); docs/config.md is generated from
the code (tests/test_readme.py). Minimum counts keep the test from passing by finding nothing.
"""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from grpo_hf import GRPOConfig
from grpo_hf.async_config import AsyncGRPOConfig

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "config.md")]
MIN_PROSE_STATEMENTS = 15  # found when this test was written: 23
MIN_TABLE_ROWS = 25  # found when this test was written: 52

FENCED = re.compile(r"^```.*?^```", re.M | re.S)
NAME = r"(?P<name>[a-z_][a-z0-9_]*)"
VALUE = r"(?P<value>`[^`\n]+`|[-+]?\d[\w.+-]*|None|True|False|'[^']*'|\"[^\"]*\")"  # code, number, literal
SAID_DEFAULT = r"(?:\(the default|\(default\b|, the default\b|\(grpo_hf's default|,? by default)"
PROSE = [
    re.compile(rf"`{NAME}=(?P<value>[^`]+)`\s*{SAID_DEFAULT}"),  # `name=value` (the default ...
    re.compile(rf"`{NAME}`[^`.;()]{{0,30}}?\((?:[^()`]{{0,12}}, )?default:? {VALUE}"),  # `name` ... (default value
    re.compile(rf"`{NAME}`[^`.;()]{{0,30}}?\({VALUE} by default"),  # `name` (value by default
    re.compile(rf"`{NAME}`[^`.;]{{0,30}}?\bdefaults to {VALUE}"),  # `name` defaults to value
    re.compile(rf"`{NAME}`[^`]{{0,60}}?\bits default,? {VALUE}"),  # `name` ...; its default, value
]
SHARED_WITH_TRL = re.compile(r"Shared with TRL: ((?:`[a-z_]+=[^`]+`(?:, )?)+)")  # porting.md: defaults TRL's too
CODE_COMMENTS = [
    re.compile(rf"\b{NAME}=(?P<value>[^,#\n]+?),?\s+#\s*(?:the |grpo_hf's )?default\b"),  # name=value,  # the default
    re.compile(rf"\b{NAME}=[^,\s#]+\)?\s+#\s*{VALUE} \(the default\)"),  # name=x)  # value (the default)
    # name=x,  # ... default is value / default cuts at value / default of value
    re.compile(rf"\b{NAME}=[^,#\n]+,?\s+#[^\n]*?\bdefault (?:is |cuts at |of )?{VALUE}"),
]
TABLE = re.compile(r"^\|(?P<header>[^\n]*)\|\n\|[-| ]+\|\n(?:\|[^\n]*\|(?:\n|$))+", re.M)
TABLE_ROW = re.compile(rf"^\| `{NAME}` \| `(?P<value>[^`]+)` \|", re.M)


@dataclasses.dataclass(frozen=True)
class Statement:
    where: str  # file:line
    name: str
    value: str  # as the docs write it
    config: type  # the config the text is about


def statements(path: Path) -> tuple[list[Statement], list[Statement]]:
    """(the statements in prose and code comments, the table rows) of one markdown page."""
    text = path.read_text(encoding="utf-8")
    prose = FENCED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)  # code blanked: offsets are the text's
    flat = re.sub(r"(?<!\n)\n(?![\n|#])", " ", prose)  # a paragraph's lines joined, same offsets

    def at(offset: int, name: str, value: str) -> Statement:
        headings = re.findall(r"^#{1,6} +(.+)$", text[:offset], re.M)
        config = AsyncGRPOConfig if headings and "AsyncGRPO" in headings[-1] else GRPOConfig
        return Statement(f"{path.name}:{text.count(chr(10), 0, offset) + 1}", name, value.strip(), config)

    said = [at(m.start(), m["name"], m["value"]) for pattern in PROSE for m in pattern.finditer(flat)]
    for m in SHARED_WITH_TRL.finditer(flat):
        said += [at(m.start(), *pair.split("=", 1)) for pair in re.findall(r"`([^`]+)`", m[1])]
    for block in FENCED.finditer(text):
        for pattern in CODE_COMMENTS:
            said += [at(block.start() + m.start(), m["name"], m["value"]) for m in pattern.finditer(block.group())]
    rows = []
    for table in TABLE.finditer(prose):
        header = [cell.strip() for cell in table["header"].split("|")]
        if header[0] == "field" and header[1] in ("default", "grpo_hf"):
            rows += [at(table.start() + m.start(), m["name"], m["value"]) for m in TABLE_ROW.finditer(table.group())]
    return said, rows


def field_defaults(statement: Statement) -> tuple[type, list] | None:
    """(the config, [its declared default, a default-built config's value]) of the field the statement names; None
    when no config has such a field (a limit, a function's argument)."""
    for config in (statement.config, AsyncGRPOConfig):
        fields = {f.name: f for f in dataclasses.fields(config)}
        if statement.name in fields:
            f = fields[statement.name]
            declared = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            return config, [declared, getattr(BUILT[config], statement.name)]
    return None


BUILT = {config: config(output_dir="unused") for config in (GRPOConfig, AsyncGRPOConfig)}


def written_value(text: str, like):
    """The Python value the docs wrote, or `...` when it is not a literal (a formula, another field's name): a number
    may carry a unit after it ("4 GiB"); a code span that is not a literal is that string where the default is one."""
    code, text = text.startswith("`") and text.endswith("`"), text.strip("`")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    if number := re.fullmatch(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.split(" ")[0]):
        return ast.literal_eval(number.group())
    return text if code and isinstance(like, str) else ...


def _same(a, b) -> bool:
    """Equal, where True is not 1 and None is not 0."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return a == b


def checkable(statement: Statement) -> bool:
    """Whether the statement names a config field and writes its value as a literal."""
    found = field_defaults(statement)
    return found is not None and written_value(statement.value, found[1][0]) is not ...


def problem(statement: Statement) -> str | None:
    """What is wrong with a checkable statement, or None when the value it writes is the field's default."""
    config, defaults = field_defaults(statement)
    value = written_value(statement.value, defaults[0])
    if any(_same(value, default) for default in defaults):
        return None
    return f"{statement.where}: {statement.name} default {statement.value}, but {config.__name__}'s is {defaults[0]!r}"


def test_the_docs_state_the_real_defaults():
    said, rows = [], []
    for path in DOCUMENTS:
        page_said, page_rows = statements(path)
        said += [s for s in page_said if checkable(s)]
        rows += [s for s in page_rows if checkable(s)]
    assert len(said) >= MIN_PROSE_STATEMENTS, [s.where for s in said]
    assert len(rows) >= MIN_TABLE_ROWS, [s.where for s in rows]
    wrong = [p for s in said + rows if (p := problem(s))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("line", "wrong"),
    [
        ("unless `max_prompt_length` (None by default) is set", None),
        ("unless `max_prompt_length` (512 by default) is set", "max_prompt_length default 512"),
        ('`reward_error_policy="skip"` (the default) scores them None', 'reward_error_policy default "skip"'),
        ("waits `vllm_server_timeout` seconds (default 60) for /health", "vllm_server_timeout default 60"),
        ("under `episode_cache_gb` (default 4 GiB, about 90,000 tokens)", None),
        ("**`max_prompt_length`** is ours (TRL has none); its default, 512, cuts", "max_prompt_length default 512"),
        ("Shared with TRL: `epsilon=0.2`, `num_generations=4`.", "num_generations default 4"),
        ("| field | grpo_hf | TRL |\n|---|---|---|\n| `beta` | `0.0` | `0.0` |", "beta default 0.0"),
        ("| field | default | meaning |\n|---|---|---|\n| `use_vllm` | `1` | on |", "use_vllm default 1"),
        ("```python\nGRPOConfig(max_prompt_length=512,  # the default\n)\n```", "max_prompt_length default 512"),
        (
            "```python\nGRPOConfig(\n    top_k=None,  # ours (the default cuts at 512 tokens)\n)\n```",
            "top_k default 512",
        ),
    ],
)
def test_the_parser_catches_a_wrong_default(tmp_path, line, wrong):
    """The phrasings the docs use, on a page of one line: a wrong value is reported, naming the field; a right one is
    found and not reported."""
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{line}\n", encoding="utf-8")
    found = [s for s in sum(statements(page), []) if checkable(s)]
    problems = [p for s in found if (p := problem(s))]
    assert found, line
    assert problems == [] if wrong is None else len(problems) == 1 and wrong in problems[0], problems
