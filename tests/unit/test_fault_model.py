"""The fault model (`fsdp_sync.faults`) against the code and docs/failures.md.

Why: the fault table of docs/failures.md is what users read to know what a failure does; it is rendered from the
declared fault points and the times the end-to-end fault tests measured (`benchmarks/results/faults.json`), so it
cannot drift from either. Every declared point must be reached by the code (a point no code calls would be a fault
test that can never fire), and an undeclared name must be refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.faults import (
    BEGIN,
    COLLECTIVES_BEGIN,
    COLLECTIVES_END,
    END,
    SERVER_BEGIN,
    SERVER_END,
    collective_runs,
    collective_table,
    point_runs,
    server_runs,
    server_table,
    table,
)
from fsdp_sync.faults import COLLECTIVES, FAULT_POINTS, FaultInjected, Injector, fault_point, injecting

ROOT = Path(__file__).resolve().parents[2]


def test_readme_fault_table_is_the_rendered_model_with_the_measured_times() -> None:
    readme = (ROOT / "docs" / "failures.md").read_text()
    assert BEGIN in readme and END in readme, "docs/failures.md lacks the fault table's markers"
    shown = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == table(), "docs/failures.md's fault table is stale: paste `python -m benchmarks.faults`"


def test_every_declared_point_was_measured() -> None:
    """Each point of the model was injected by the end-to-end fault tests in the recorded run."""
    measured = {t["point"] for timings in point_runs().values() for t in timings}
    assert measured == set(FAULT_POINTS), f"not measured: {sorted(set(FAULT_POINTS) - measured)}"


def test_server_fault_table_is_the_measured_one() -> None:
    """docs/server.md's table of server faults (stopped, killed, restarted) is rendered from the recorded runs of
    tests/e2e/test_recovery.py, and each fault cost at most one failed sync (the next one succeeded)."""
    page = (ROOT / "docs" / "server.md").read_text()
    assert SERVER_BEGIN in page and SERVER_END in page, "docs/server.md lacks the server-fault table's markers"
    shown = page.split(SERVER_BEGIN, 1)[1].split(SERVER_END, 1)[0].strip()
    assert shown == server_table(), "docs/server.md's server-fault table is stale: paste `python -m benchmarks.faults`"
    records = [r for rows in server_runs().values() for r in rows]
    assert records, "no server fault was measured"
    assert all(r["next"] != "failed" for r in records), [r for r in records if r["next"] == "failed"]


def test_collective_fault_table_is_the_measured_one() -> None:
    """docs/failures.md's table of the sync's collectives is rendered from the recorded runs of
    tests/dist/test_collective_faults.py; every declared collective was faulted, every rank raised, in seconds."""
    page = (ROOT / "docs" / "failures.md").read_text()
    assert COLLECTIVES_BEGIN in page and COLLECTIVES_END in page, "docs/failures.md lacks the collectives' markers"
    shown = page.split(COLLECTIVES_BEGIN, 1)[1].split(COLLECTIVES_END, 1)[0].strip()
    assert shown == collective_table(), "docs/failures.md's collectives table is stale: paste `python -m benchmarks.faults`"
    records = [r for rows in collective_runs().values() for r in rows]
    assert {r["collective"] for r in records} == set(COLLECTIVES), "a declared collective was never faulted"
    assert all(r["type"] and r["seconds"] < 5 for r in records), [r for r in records if r["seconds"] >= 5]


def test_every_declared_point_is_called_by_the_library() -> None:
    calls: set[str] = set()
    for path in (ROOT / "fsdp_sync").rglob("*.py"):
        calls.update(re.findall(r'fault_point\(\s*"([a-z.]+)"', path.read_text()))
    assert calls == set(FAULT_POINTS), (sorted(set(FAULT_POINTS) - calls), sorted(calls - set(FAULT_POINTS)))


def test_the_seam_fires_only_where_armed_and_refuses_unknown_points() -> None:
    injector = Injector(lambda point, context: point == "write" and context.get("name") == "b")
    with injecting(injector):
        fault_point("write", name="a")
        with pytest.raises(FaultInjected, match="write"):
            fault_point("write", name="b")
        with pytest.raises(KeyError, match="unknown fault point"):
            fault_point("no.such.point")
    assert injector.reached == {"write": 2} and [p for p, _ in injector.fired] == ["write"]
    fault_point("write", name="b")  # no injector: nothing happens
