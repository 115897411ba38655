"""Local paths versus Hub ids: the check every loader runs before `from_pretrained` (policy, tokenizer, reward model).

A leaf module of the standard library only: it imports nothing of grpo_hf, so `grpo_hf.rewards` (whose reward
models load from paths) may use it without reaching above its layer.
"""

from __future__ import annotations

import os

__all__ = ["check_local_path", "looks_like_local_path"]


def looks_like_local_path(name: str) -> bool:
    """True for a string that can only be a local path, never a Hub id ("name" or "org/name")."""
    return (
        name.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or name in (".", "..")
        or name.count("/") > 1
        or "\\" in name
        or name.endswith("/")
        or os.path.isabs(name)
    )


def check_local_path(name_or_path: str, what: str = "model") -> str:
    """`name_or_path` with `~` expanded; FileNotFoundError if it looks like a local path that does not exist."""
    path = os.path.expanduser(name_or_path)
    if looks_like_local_path(name_or_path) and not os.path.exists(path):
        raise FileNotFoundError(
            f"The {what} path {name_or_path!r} does not exist (looked for {os.path.abspath(path)!r}). Check the "
            "path, or pass a Hub id of the form 'org/name'."
        )
    if os.path.isfile(path):
        raise NotADirectoryError(
            f"The {what} path {name_or_path!r} is a file; pass the directory that holds its config.json (a "
            "save_pretrained directory)."
        )
    return path
