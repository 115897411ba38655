"""The recipes' command line: `--config file.yaml` sets the defaults of the script's dataclasses (its
`ScriptArguments` and `grpo_hf.GRPOConfig`), and the other flags override them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import yaml
from transformers import HfArgumentParser


def parse_config_args(
    dtypes: tuple[type, ...],
    argv: list[str] | None,
    script: str,
    check: Callable[[argparse.Namespace, str], None] | None = None,
) -> tuple:
    """One instance of each of `dtypes`, from `argv` (default: the command line) over the YAML file of `--config`.
    A key of the file that no dataclass has is an error naming it; `check(namespace, source)` sees the parsed values
    (and where they came from, for its messages) before the dataclasses are built."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)

    parser = HfArgumentParser(dtypes)
    parser.add_argument("--config", default=None, help="YAML file whose keys are the fields below.")
    source = "the command line"
    if known.config:
        values = yaml.safe_load(Path(known.config).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{known.config} must hold a mapping of field names to values.")
        unknown = sorted(set(values) - {action.dest for action in parser._actions})
        if unknown:
            names = " or ".join(dtype.__name__ for dtype in dtypes)
            raise ValueError(
                f"{known.config}: unknown key(s) {unknown}. Keys are field names of {names}; "
                f"`python {script} --help` lists them."
            )
        parser.set_defaults(**values)
        source = f"{known.config} or the command line"
    namespace = parser.parse_args(argv)
    if check is not None:
        check(namespace, source)
    return tuple(
        dtype(**{k: v for k, v in vars(namespace).items() if k in {f.name for f in fields(dtype) if f.init}})
        for dtype in dtypes
    )
