"""Every `torch.distributed` call in `fsdp_sync/` goes through the sync's one guard, or is listed here with what bounds
it (issue 36).

Why: a collective that one rank leaves keeps the others inside it. The sync calls each of its collectives through
`fsdp_sync.distributed.collective(name, torch.distributed.<fn>, ...)`, under a name declared in
`fsdp_sync.faults.COLLECTIVES` (the table docs/failures.md lists, with the group each runs on and what happens when
it raises on one rank). A new `dist.all_gather(...)` written anywhere else would be outside that model, silently:
this test reads every module's source and fails naming it. Calls that are not collectives of a sync (the demo's
launcher, group creation) and the collectives torch runs for FSDP's own unshard paths are listed in `OUTSIDE`, each
with the reason and the bound docs/failures.md gives it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch.distributed as dist

from fsdp_sync.faults import COLLECTIVES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_sync"

# torch.distributed's collectives and group lifecycle calls (those of this torch; each name is checked to exist).
DIST_FUNCTIONS = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list", "new_group", "new_subgroups", "init_process_group", "destroy_process_group",
}  # fmt: skip
# Methods that run collectives on objects rather than through the module: a process group's own, FSDP's, DTensor's.
METHODS = {"allgather", "allreduce", "broadcast", "barrier", "summon_full_params", "unshard", "full_tensor"}

# (module, function or method) -> why it does not go through the guard, and what bounds it.
OUTSIDE: dict[tuple[str, str], str] = {
    ("_demo/grpo_job.py", "destroy_process_group"): "the demo job at exit",
    ("_demo/grpo_job.py", "monitored_barrier"): "the demo job's own bounded barrier at exit, no sync",
    ("dry_run.py", "init_process_group"): "the dry run's one-process world",
    ("dry_run.py", "destroy_process_group"): "the dry run's one-process world",
    ("distributed.py", "new_group"): "the sync's own groups made (a collective of the training world's store, "
    "bounded by the store's timeout; at the start of a sync, every rank)",
    ("distributed.py", "destroy_process_group"): "the sync's own groups destroyed (an abort, or at exit)",
    ("transfer/gloo_wire.py", "broadcast"): "the transfer group between rank 0 and a server (no other training rank); "
    "bounded by the writer's deadline (`sync_timeout_s`), docs/server.md",
    ("transfer/gloo_wire.py", "allgather"): "the transfer group's answers (`gather_to_sender`, its sizes, then its "
    "gather: rank 0 and a server's workers, no other training rank); bounded by the writer's deadline "
    "(`sync_timeout_s`)",
    ("full_weights.py", "summon_full_params"): "FSDP1's own all-gathers (`full_state`, outside a sync): bounded by "
    "the training group's timeout only",
    ("full_weights.py", "unshard"): "FSDP2's own all-gathers (`full_state`, outside a sync): the training group's "
    "timeout only",
    ("gather/fsdp1.py", "summon_full_params"): "FSDP1's own all-gathers (fsdp1_strategy unit/root, not the "
    "default): the training group's timeout only, docs/failures.md",
    ("gather/fsdp2.py", "unshard"): "FSDP2's own all-gathers (fsdp2_strategy unit, not the default): the training "
    "group's timeout only, docs/failures.md",
    ("gather/fsdp2.py", "full_tensor"): "DTensor's all-gather of a parameter the flat gather does not cover, or "
    "fsdp2_strategy param: the training group's timeout only, docs/failures.md",
}  # fmt: skip


def _dist_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """The names this module binds to `torch.distributed`, and those bound to its functions (alias -> function)."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or alias.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    functions[alias.asname or alias.name] = alias.name
    return modules, functions


def distributed_calls(package: Path = PACKAGE) -> list[tuple[str, int, str, bool]]:
    """Every reference to a torch.distributed function and every call of a collective method in the modules under
    `package` (`fsdp_sync/`): (module, line, name, whether it is the collective `fsdp_sync.distributed.collective`
    is given)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules, functions = _dist_aliases(tree)
        guarded: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "collective":
                if len(node.args) >= 2:
                    guarded.add(id(node.args[1]))
        module = str(path.relative_to(package))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                name = node.attr if node.attr in DIST_FUNCTIONS else None
            elif isinstance(node, ast.Name) and functions.get(node.id) in DIST_FUNCTIONS:
                name = functions[node.id]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in METHODS:
                receiver = node.func.value
                # `Coordinator.broadcast` is the sync's own (its exchange goes through the guard).
                own = getattr(receiver, "id", getattr(receiver, "attr", "")) == "coordinator"
                if not own and not (isinstance(receiver, ast.Name) and receiver.id in modules):
                    name = node.func.attr
            if name is not None:
                found.append((module, node.lineno, name, id(node) in guarded))
    return found


def test_the_listed_functions_are_torch_distributed_functions() -> None:
    missing = sorted(n for n in DIST_FUNCTIONS if not hasattr(dist, n))
    assert not missing, f"not in this torch's torch.distributed (update DIST_FUNCTIONS): {missing}"


def test_every_torch_distributed_call_goes_through_the_guard_or_is_listed_with_its_bound() -> None:
    calls = distributed_calls()
    assert any(guarded for *_, guarded in calls), "no collective found going through the guard: the scan is broken"
    bypassing = [f"fsdp_sync/{m}:{line}: {n}" for m, line, n, guarded in calls if not guarded and (m, n) not in OUTSIDE]
    assert not bypassing, (
        "torch.distributed called outside `fsdp_sync.distributed.collective` (declare the collective in "
        f"fsdp_sync.faults.COLLECTIVES and call it through the guard, inside the failure model): {bypassing}"
    )
    listed = {(m, n) for m, _, n, guarded in calls if not guarded}
    stale = sorted(set(OUTSIDE) - listed)
    assert not stale, f"OUTSIDE lists calls the code no longer makes: {stale}"


def test_every_declared_collective_is_called_and_every_call_is_declared() -> None:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names.update(re.findall(r'collective\(\s*"([a-z._]+)"', path.read_text()))
        names.update(re.findall(r'\.run\(\s*"([a-z._]+)"', path.read_text()))
    assert names == set(COLLECTIVES), (sorted(set(COLLECTIVES) - names), sorted(names - set(COLLECTIVES)))


def test_a_bypass_is_found(tmp_path: Path) -> None:
    """The scan sees a direct call, an aliased import and a method collective (so it cannot pass by seeing none).

    NOTE: the probe module is scanned in a temporary directory, never written into `fsdp_sync/`: a checkout may be
    read-only, and a test that walks the package at the same time (the layering test) would see it."""
    source = (
        "import torch.distributed as d\nfrom torch.distributed import all_reduce as ar\n"
        "def f(t, g, m):\n    d.all_gather_into_tensor(t, t)\n    ar(t)\n    m.unshard()\n"
        "    collective('x', d.broadcast, t, 0)\n    self.coordinator.broadcast(t)\n"
    )
    tree = ast.parse(source)
    modules, functions = _dist_aliases(tree)
    assert modules == {"d"} and functions == {"ar": "all_reduce"}
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    calls = [(n, guarded) for m, _, n, guarded in distributed_calls(tmp_path) if m == probe.name]
    assert sorted(calls) == [("all_gather_into_tensor", False), ("all_reduce", False), ("broadcast", True),
                             ("unshard", False)], calls  # fmt: skip
