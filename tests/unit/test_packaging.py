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
