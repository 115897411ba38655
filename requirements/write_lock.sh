#!/usr/bin/env bash
# Write the lock of environment VENV to OUT: every installed distribution at its exact version, as pip constraints
# (`pip install -c OUT`), with a header naming when, where and on what it passed. torch is left out: TORCH_SPEC in the
# Makefile pins it (a CPU build here; GPU machines install their own build). Called by `make lock` after the suite
# passed in VENV.
set -euo pipefail
venv=$1
out=$2
py="$venv/bin/python"
{
    echo "# grpo_hf's lock: the exact versions \`make test\` passed on, as pip constraints (make install reads it)."
    echo "# Written on $(date -u +%Y-%m-%d) from an environment of the newest versions pyproject.toml allowed that day, after the"
    echo "# whole suite passed in it (make lock does both):"
    echo "# $("$py" requirements/versions.py), on $(uname -m) $(uname -s)."
    echo "# torch is pinned by the Makefile's TORCH_SPEC, not here. Refresh: make lock (docs/versions.md)."
    "$py" -m pip freeze --all --exclude-editable | grep -v -i -E '^(torch|nvidia-[a-z0-9-]+)==' | LC_ALL=C sort -f
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out ($(grep -c '==' "$out") pins)"
