"""`fsdp_sync.distributed.free_port`: a port free now, outside the kernel's ephemeral range where the platform says
where it is, so that no socket binding port 0 or connecting out is handed it before its user listens there (a CI
run lost a server test to that: the trainer's weight-transfer port taken between the test picking it and the job
listening, EADDRINUSE)."""

from __future__ import annotations

import socket

import pytest

from fsdp_sync import distributed
from fsdp_sync.distributed import free_port

pytestmark = pytest.mark.unit


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low = distributed._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a listener could take it
        if low is not None and low > 2048:
            assert max(1024, low - 12000) <= port < low, (port, low)
    assert len(ports) > 1, "ports picked at random, not one sequence every process repeats"


def test_a_taken_port_is_skipped_and_an_unknown_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(distributed, "_ephemeral_low", lambda: busy + 1)
        # Every candidate below `busy + 1` in a one-port window would be `busy` itself: taken, so the kernel's port.
        monkeypatch.setattr(distributed.random.SystemRandom, "randrange", lambda self, a, b: busy)
        assert free_port() != busy
    monkeypatch.setattr(distributed, "_ephemeral_low", lambda: None)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
