"""The distribution as a user installs it: package list, import names, and a user project's own `compat` package."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_declared() -> None:
    """`[tool.setuptools] packages` is an explicit list (compat/ maps to `fsdp_sync.compat`); a new subpackage that
    is not listed would be missing from wheels while the editable test install still finds it."""
    setuptools = _pyproject()["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fsdp_sync").rglob("__init__.py")
    } | {"fsdp_sync.compat"}
    assert declared == on_disk
    assert setuptools["package-dir"] == {"fsdp_sync.compat": "compat"}


def test_compat_is_importable_only_under_the_distribution_name(tmp_path: Path) -> None:
    """A user project with its own top-level `compat` package (a common name) imports the library fine, and keeps
    its own `compat`."""
    project = tmp_path / "user_project"
    (project / "compat").mkdir(parents=True)
    (project / "compat" / "__init__.py").write_text("USERS_OWN = True\n")
    code = (
        "import compat\n"
        "assert compat.USERS_OWN, compat.__file__\n"
        "from fsdp_sync import FSDPVLLMSyncMixin, SyncConfig\n"
        "from fsdp_sync.compat.manifest import check_plan\n"
        "import fsdp_sync.compat.names as names\n"
        "assert 'user_project' not in names.__file__\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_lazy_top_level_does_not_import_the_runtime() -> None:
    """Importing the pure tables (as the vLLM-side plugin does) loads neither the mixin nor the gatherers."""
    code = (
        "import sys\n"
        "import fsdp_sync.compat.manifest\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('fsdp_sync.') and not m.startswith('fsdp_sync.compat'))\n"
        "print(loaded)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


# What `fsdp_sync._demo` ships: the demo's job, its weight check and what they run (`fsdp-vllm-sync-demo`). The test
# job, its faults and probes, the fork server and the distributed launcher live in `tests/support` and never ship.
DEMO_MODULES = {
    "__init__", "after_import", "cpu_fsdp", "engine", "grpo_job", "launch", "models", "no_torchvision",
    "vllm_server", "weight_check", "site/__init__", "site/sitecustomize",
}  # fmt: skip


def test_the_wheel_holds_the_library_and_the_demo_and_no_test_machinery(tmp_path: Path) -> None:
    """The wheel a user installs, built from the tracked sources: only `fsdp_sync` (with `compat` under it), the
    demo's modules in `_demo` (under 3,000 lines), and no module that imports the tests."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    for part in ("fsdp_sync", "compat"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("fsdp_vllm_sync-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        modules = {n: archive.read(n).decode() for n in archive.namelist() if n.endswith(".py")}
    outside = sorted(n for n in modules if not n.startswith("fsdp_sync/"))
    assert not outside, f"the wheel holds modules outside fsdp_sync/: {outside}"
    demo = {n.removeprefix("fsdp_sync/_demo/").removesuffix(".py") for n in modules if n.startswith("fsdp_sync/_demo/")}
    assert demo == DEMO_MODULES, f"_demo ships {sorted(demo - DEMO_MODULES)} beyond the demo; lacks {sorted(DEMO_MODULES - demo)}"
    demo_lines = sum(modules[f"fsdp_sync/_demo/{m}.py"].count("\n") for m in demo)
    assert demo_lines < 3000, f"_demo ships {demo_lines} lines"
    importing_tests = sorted(
        n for n, text in modules.items() if any(line.lstrip().startswith(("from tests", "import tests"))
                                                 for line in text.splitlines())
    )  # fmt: skip
    assert not importing_tests, f"shipped modules import the tests: {importing_tests}"
    assert "fsdp_sync/compat/__init__.py" in modules and "fsdp_sync/mixin.py" in modules
