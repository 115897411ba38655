"""Two helpers for settings and messages, standard library only: `as_dict` reads a dict-valued setting given as a
dict, JSON text (the command line) or None; `with_article` names a value's type in a message ('an int')."""

from __future__ import annotations

import json


def as_dict(value, name: str) -> dict:
    """A dict-valued field (`model_init_kwargs`, `generation_kwargs`, ...) given as a dict, JSON text or None."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} must be a dict or a JSON object string; got {value!r}.") from err
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict; got {type(value).__name__}.")
    return value


def with_article(noun: str) -> str:
    """'a str', 'an int': a type name with its indefinite article, for messages about a value's type."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
