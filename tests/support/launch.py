"""The tests' job launcher: the demo's (`fsdp_sync._demo.launch`), with the ranks forked from the session's fork
server where one runs (`prefork.py`), and the repository importable in every rank (the jobs live in `tests.support`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdp_sync._demo import launch as demo_launch
from fsdp_sync._demo.launch import LaunchRefused, LaunchResult

from .prefork import PREFORK_ENV, PreforkRefused, run_on_server

__all__ = ["LaunchResult", "launch_env", "launch_job"]

REPO = Path(__file__).resolve().parents[2]


def launch_env() -> dict[str, str]:
    """The environment every test job is launched with (and the fork server started with): the demo's, with the
    repository on PYTHONPATH (last: what the caller put there comes first); the fork server's socket is not passed on (a job needs none)."""
    env = demo_launch.launch_env()
    env.pop(PREFORK_ENV, None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO)])
    return env


def _forked(socket_path: str) -> demo_launch.Runner:
    def run(**request: Any) -> int:
        try:
            return run_on_server(socket_path, **request)
        except PreforkRefused as e:
            raise LaunchRefused(f"not forked from the fork server ({e})") from e

    return run


def launch_job(
    module: str, job_args: list[str], out_dir: str | Path, *, share_imports: bool = True, **options: Any
) -> LaunchResult:
    """`fsdp_sync._demo.launch.launch_job`; where the session runs a fork server (`PREFORK_ENV` names its socket)
    and `share_imports` is on, the ranks are forked from it with the environment `accelerate launch` gives them."""
    server = os.environ.get(PREFORK_ENV, "0") if share_imports else "0"
    runner = _forked(server) if server != "0" else None
    return demo_launch.launch_job(module, job_args, out_dir, runner=runner, env=launch_env(), **options)
