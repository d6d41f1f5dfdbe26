"""The fault model of a sync: every point where one rank can fail on its own, and the seam that injects faults there.

Why a seam: a fault test that patches the library's private methods goes quiet when a refactor renames them. Here
the library itself calls `fault_point(name, ...)` at every such point, the points are a declared list
(`FAULT_POINTS`, rendered into docs/failures.md), and `fault_point` refuses a name that is not in it. A test
installs an `Injector` and checks that every point it armed was reached, so a point that disappears from the code
fails that test instead of silently passing it.

Cost when no injector is installed: one global read and one comparison per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COLLECTIVES",
    "Collective",
    "FAULT_POINTS",
    "FaultInjected",
    "FaultPoint",
    "Injector",
    "fault_point",
    "injecting",
]


@dataclass(frozen=True)
class FaultPoint:
    """One place where one rank can fail on its own during a sync.

    Attributes:
        stage: the stage every rank's `SyncError` names for it (`RankFailure.stage`).
        where: what runs there.
        engine: what every engine holds afterwards: `"unchanged"` (nothing of the sync reached any engine),
            `"previous or new"` (each engine weight holds its previous or its new value; the error lists those still
            previous), `"new"` (every weight of the sync is in: a failure after the push).
    """

    stage: str
    where: str
    engine: str


# In the order a sync reaches them.
FAULT_POINTS: dict[str, FaultPoint] = {
    "build": FaultPoint("build", "building the sync at the first call (backend, gatherer, writer, engine handle)",
                        "unchanged"),
    "plan": FaultPoint("plan", "the names and the plan's check against the engine's checkpoint (files, server routes)",
                       "unchanged"),
    "check": FaultPoint("check", "the local checks before any gather (the delta fingerprints, check_finite)",
                        "unchanged"),
    "agree.exchange": FaultPoint("agree", "inside the control collective that shares what each rank found (the "
                                 "delta selection), after every rank entered it", "unchanged"),
    "sparse.diff": FaultPoint("patch", "this rank's pieces diffed against its snapshot (sparse syncs)", "unchanged"),
    "sparse.count": FaultPoint("patch", "this rank's change counts, before the ranks exchange them", "unchanged"),
    "sparse.pack": FaultPoint("patch", "what goes whole decided, this rank's patches encoded, before the patch "
                              "gathers", "unchanged"),
    "sparse.unpack": FaultPoint("patch", "the gathered patches decoded (the ranks that push them)", "unchanged"),
    "gather.prepare": FaultPoint("gather", "this rank's shard of one unit: read, moved, cast, output allocated",
                                 "previous or new"),
    "gather.launch": FaultPoint("gather", "the call that starts one unit's all-gather (after every rank's shard was "
                                "ready)", "previous or new"),
    "gather.unflatten": FaultPoint("gather", "a gathered unit turned into its parameters' full tensors",
                                   "previous or new"),
    "stream.map": FaultPoint("map", "a gathered tensor's checkpoint name", "previous or new"),
    "stream.merge": FaultPoint("merge", "the PEFT merge of a gathered tensor", "previous or new"),
    "stream.cast": FaultPoint("cast", "the layout conversion and the cast to the engine's dtype", "previous or new"),
    "write": FaultPoint("push", "the engine or the transport taking one tensor (colocate: the in-place reload; "
                        "server: the send)", "previous or new"),
    "write.patches": FaultPoint("push", "the engine taking the patches of a sparse sync (colocate: vLLM's patch "
                                "loader; server: the sparse round)", "previous or new"),
    "write.finish": FaultPoint("push", "after a complete push (the prefix-cache reset, the server's answer)", "new"),
    "agree.outcome": FaultPoint("agree", "inside the control collective on a stage's outcome (here the push's), after "
                                "every rank entered it", "new"),
    "verify": FaultPoint("verify", "reading the engine's digests back (SyncConfig.verify)", "new"),
}  # fmt: skip


@dataclass(frozen=True)
class Collective:
    """One collective a sync calls through `fsdp_sync.distributed.collective` (the one place that calls them).

    A collective is the other kind of place where one rank can fail on its own: its call raises on that rank while
    the others are inside it. Declared here so that docs/failures.md lists every one with what bounds its wait, and
    tests/unit/test_guarded_collectives.py fails when the library calls a `torch.distributed` collective elsewhere.

    Attributes:
        stage: the stage every rank's `SyncError` names when it raises on one rank.
        group: `"control"`: one of the sync's own gloo groups, which a rank that fails inside it destroys, so the others
            fail at once (`Coordinator`); `"training"`: the trainer's process group, which cannot be aborted, so a
            rank that fails to launch it joins it again with a zero shard (`gather.collectives.launch_or_join`).
        where: what it carries.
    """

    stage: str
    group: str
    where: str


# In the order a sync reaches them.
COLLECTIVES: dict[str, Collective] = {
    "agree.barrier": Collective("agree", "control", "the barrier that opens an agreement or an exchange (gloo's "
                                "monitored barrier: it names the ranks that did not arrive)"),
    "agree.items": Collective("agree", "control", "every rank's item of an exchange (the delta selection, the "
                              "sparse readiness), or every rank's failure after a failed agreement"),
    "agree.flag": Collective("agree", "control", "whether any rank failed the stage agreed on"),
    "round.flags": Collective("agree", "control", "a status round: one byte per rank, whether it failed so far "
                              "(before each unit's all-gather and before each gathered unit is handed on)"),
    "patch.counts": Collective("patch", "control", "every rank's change counts of a sparse sync"),
    "patch.gather": Collective("patch", "control", "every rank's encoded patches (to every rank in colocate mode, "
                               "to rank 0 in server mode)"),
    "gather.weights": Collective("gather", "training", "one unit's all-gather of the weight shards (the flat "
                                 "strategies, the default)"),
    "adapter.pieces": Collective("adapter.pieces", "control", "every rank's pieces of a LoRA adapter (an adapter "
                                 "sync: sizes, places and values, three all-gathers per dtype)"),
}  # fmt: skip


class FaultInjected(RuntimeError):
    """The error an injected fault raises."""


def _no_fault(point: str, context: dict[str, Any]) -> None:
    return None


_injector: Callable[[str, dict[str, Any]], None] = _no_fault


def fault_point(point: str, **context: Any) -> None:
    """Mark a fault point: raises `FaultInjected` where an injector says so, else nothing.

    Args:
        point: a name of `FAULT_POINTS`.
        context: what identifies this call (`unit`, `units`, `name`, ...), for the injector.
    """
    if _injector is _no_fault:
        return
    if point not in FAULT_POINTS:
        raise KeyError(f"unknown fault point {point!r}; declared: {sorted(FAULT_POINTS)}")
    _injector(point, context)


@dataclass
class Injector:
    """Fails the calls of `fault_point` that `should_fail(point, context)` accepts, and records every point reached.

    Attributes:
        reached: how many times each point was called while installed.
        fired: `(point, context)` of every fault raised.
    """

    should_fail: Callable[[str, dict[str, Any]], bool]
    reached: dict[str, int] = field(default_factory=dict)
    fired: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, point: str, context: dict[str, Any]) -> None:
        self.reached[point] = self.reached.get(point, 0) + 1
        if self.should_fail(point, context):
            self.fired.append((point, dict(context)))
            raise FaultInjected(f"injected fault at {point} ({', '.join(f'{k}={v}' for k, v in context.items())})")


@contextlib.contextmanager
def injecting(injector: Callable[[str, dict[str, Any]], None]) -> Iterator[None]:
    """While the block runs, every `fault_point` call goes to `injector`."""
    global _injector
    previous, _injector = _injector, injector
    try:
        yield
    finally:
        _injector = previous
