"""What each test suite costs, read from pytest's junit reports (docs/testing.md's CI budget).

    python -m benchmarks.ci_suites --note "what ran, where" REPORT.xml [REPORT.xml ...]

Writes benchmarks/results/ci-suites-cpu.{json,md}: the whole run's time where given (`--whole-run-s`), per suite
(unit, dist, e2e) the tests and seconds (setup, call and teardown, as junit counts them), per e2e module the seconds,
and the slowest tests. CI prints the same figures on
every run (`.ci/matrix.py summary`); this file keeps one run's for the docs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SLOWEST = 15


def cases(reports: list[Path]) -> list[dict[str, object]]:
    found = []
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            parts = (case.get("classname") or "").split(".")
            failed = case.find("failure") is not None or case.find("error") is not None
            found.append({
                "suite": parts[1] if len(parts) > 2 and parts[0] == "tests" else "?",
                "module": parts[2] if len(parts) > 2 else "?",
                "test": f"{case.get('classname')}::{case.get('name')}",
                "seconds": float(case.get("time") or 0),
                "outcome": "failed" if failed else "skipped" if case.find("skipped") is not None else "passed",
            })  # fmt: skip
    return found


def render(found: list[dict[str, object]], note: str, whole_run_s: float | None = None) -> str:
    head = (f"Measured {date.today().isoformat()}. Machine: {platform.machine()} CPU, {os.cpu_count()} cores; {note}")
    lines = [head, ""]
    if whole_run_s is not None:  # as `.ci/run` printed it: every leg, set-up included
        lines += ["| run | seconds | minutes |", "|---|---|---|", f"| whole .ci/run | {whole_run_s:.0f} | {whole_run_s / 60:.1f} |", ""]
    lines += ["| suite | tests | failed | seconds | minutes |", "|---|---|---|---|---|"]
    suites: dict[str, list[dict[str, object]]] = {}
    for case in found:
        suites.setdefault(str(case["suite"]), []).append(case)
    for suite, cs in sorted(suites.items()):
        seconds = sum(float(c["seconds"]) for c in cs)
        failed = sum(c["outcome"] == "failed" for c in cs)
        lines.append(f"| {suite} | {len(cs)} | {failed} | {seconds:.0f} | {seconds / 60:.1f} |")
    lines += ["", "| e2e module | tests | seconds |", "|---|---|---|"]
    modules: dict[str, list[float]] = {}
    for case in found:
        if case["suite"] == "e2e":
            modules.setdefault(str(case["module"]), []).append(float(case["seconds"]))
    for module, secs in sorted(modules.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {module} | {len(secs)} | {sum(secs):.0f} |")
    lines += ["", f"| slowest {SLOWEST} tests | seconds |", "|---|---|"]
    for case in sorted(found, key=lambda c: -float(c["seconds"]))[:SLOWEST]:
        lines.append(f"| {case['test']} | {float(case['seconds']):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--note", required=True, help="what ran and under what load")
    parser.add_argument("--whole-run-s", type=float, default=None, help="the whole `.ci/run`'s seconds, as it printed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    found = cases(args.reports)
    (args.results / "ci-suites-cpu.json").write_text(json.dumps(found, indent=1) + "\n")
    text = render(found, args.note, args.whole_run_s)
    (args.results / "ci-suites-cpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
