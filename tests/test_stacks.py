"""The versions pyproject.toml declares are the versions CI tests: each bounded dependency's range
starts at its pin in the oldest stack and ends after its pin in the newest (scripts/stacks/*.txt,
the stacks that scripts/install.sh installs and .ci/run tests), up to the next minor release."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
BOUNDED = ("torch", "transformers", "accelerate", "peft", "trl")  # Triton: the version torch takes


def _pins(stack: str) -> dict[str, Version]:
    lines = (ROOT / "scripts" / "stacks" / f"{stack}.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(p.specifier) == 1 and next(iter(p.specifier)).operator == "==" for p in pins), pins
    return {p.name: Version(next(iter(p.specifier)).version) for p in pins}


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {req.name: req for req in map(Requirement, requirements) if req.name in BOUNDED}


def test_every_declared_range_runs_from_the_oldest_stack_to_the_newest():
    oldest, newest, declared = _pins("oldest"), _pins("newest"), _declared()
    assert set(declared) == set(BOUNDED) and set(BOUNDED) <= set(oldest) & set(newest), (declared, oldest, newest)
    for name in BOUNDED:
        spec = declared[name].specifier
        lower = [Version(s.version) for s in spec if s.operator == ">="]
        assert lower == [oldest[name]], f"{name}{spec}: its lower bound must be the oldest stack's {oldest[name]}"
        assert newest[name] in spec, f"{name}{spec} excludes the newest stack's {newest[name]}"
        next_minor = Version(f"{newest[name].major}.{newest[name].minor + 1}")
        assert next_minor not in spec, f"{name}{spec} admits {next_minor}, newer than any stack CI tests"
