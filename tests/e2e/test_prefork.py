"""The fork server that starts the end-to-end jobs' ranks (tests/support/prefork.py) behaves as `accelerate launch`.

Its probe (`python -m tests.support.prefork dump-env DIR`) writes each rank's environment and pid; the same probe
is launched for real and forked, and the two compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.launch import launch_env, launch_job
from tests.support.prefork import PREFORK_ENV, PreforkServer

pytestmark = pytest.mark.e2e

PROBE = "tests.support.prefork"
# What the fork server sets differently, on purpose (see prefork.py), and what pytest changes from test to test.
EXPECTED_DIFFERENCES = {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "PYTEST_CURRENT_TEST"}


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory):
    """A fork server started with the environment as it is now: earlier tests' libraries may have set variables in
    this process since the session's server started (the session's jobs are then launched for real, correctly but
    slower), and these tests are about the server, not about that drift."""
    server = PreforkServer(tmp_path_factory.mktemp("prefork-own"), launch_env())
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _use_own_server(own_server: PreforkServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFORK_ENV, own_server.socket_path)


def _envs(directory: Path, ranks: int) -> list[dict[str, str]]:
    return [json.loads((directory / f"env{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("backend,ranks", [("fsdp1", 2), ("fsdp2", 3)])
def test_forked_ranks_get_the_environment_accelerate_launch_gives_them(backend, ranks, tmp_path):
    real, forked = tmp_path / "real", tmp_path / "forked"
    for directory, share in ((real, False), (forked, True)):
        result = launch_job(PROBE, ["dump-env", str(directory)], directory, backend=backend, num_processes=ranks,
                            share_imports=share, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.log[-3000:]
    assert "[prefork] ranks exited with" in (forked / "launch.log").read_text()
    assert "[prefork]" not in (real / "launch.log").read_text()
    for r, (a, b) in enumerate(zip(_envs(real, ranks), _envs(forked, ranks), strict=True)):
        differs = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert differs <= EXPECTED_DIFFERENCES, f"rank {r}: {sorted(differs - EXPECTED_DIFFERENCES)}"
        assert a["RANK"] == b["RANK"] == str(r) and b["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_a_failing_rank_fails_the_job_and_the_others_are_stopped(tmp_path):
    """As torchrun: one rank exits 3, the other (asleep for 10 minutes) is stopped, the job's exit code is 1."""
    start = time.monotonic()
    result = launch_job(PROBE, ["dump-env", str(tmp_path), "--fail-rank", "1", "--sleep", "600"], tmp_path,
                        backend="fsdp2", num_processes=2, timeout=300)  # fmt: skip
    assert result.returncode == 1, result.log[-3000:]
    assert time.monotonic() - start < 60
    assert "[prefork] ranks exited with [-15, 3]" in result.log
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid0").read_text()), 0)


def test_a_job_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        launch_job(PROBE, ["dump-env", str(tmp_path), "--sleep", "600"], tmp_path, backend="ddp", num_processes=2,
                   timeout=5)  # fmt: skip
    for r in range(2):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid{r}").read_text()), 0)


def test_a_job_whose_environment_differs_is_launched_for_real(tmp_path, monkeypatch):
    """A variable read at import time (here PYTHONPATH, for a `sitecustomize`) cannot be changed in a forked rank."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    result = launch_job(PROBE, ["dump-env", str(tmp_path)], tmp_path, backend="single", timeout=300)
    assert result.returncode == 0, result.log[-3000:]
    assert "not forked from the fork server" in result.log and "PYTHONPATH" in result.log
    assert _envs(tmp_path, 1)[0]["PYTHONPATH"].startswith(str(tmp_path))
