"""`python -m fsdp_sync.server_check` without a server: what a user sees (the live checks run against the
tensor-parallel and data-parallel servers in tests/e2e/test_multi_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_sync.distributed import free_port
from fsdp_sync.server_check import main


def test_a_server_that_cannot_be_reached_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--server", url, "--weights", str(tmp_path), "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m fsdp_sync.server_check: ") and url in err and "\n" not in err, err


def test_the_server_and_the_weights_are_required(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--server", "http://127.0.0.1:8000"])
    assert exited.value.code == 2 and "--weights" in capsys.readouterr().err
