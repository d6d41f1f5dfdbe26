"""The import structure, read from the source (every import: at module level, in `TYPE_CHECKING` blocks and inside
functions): no import circle anywhere in the package; `compat/` imports nothing of `fsdp_sync` but itself; the code
that runs inside a vLLM server process (`fsdp_sync/transfer/`) imports no gatherer, no mixin and no TRL; the writers
and the transfer import nothing of the sync that drives them (`fsdp_sync/sync/`): what both ends share lives at the
bottom (`fsdp_sync.patch_codec`, `fsdp_sync.digest`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for base, package in ((ROOT / "fsdp_sync", "fsdp_sync"), (ROOT / "compat", "fsdp_sync.compat")):
        for f in base.rglob("*.py"):
            parts = [p for p in f.relative_to(base).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = f
    return mods


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (n.level - 1)] if n.level else []
            target = ".".join(base + ([n.module] if n.module else [])) if n.level else (n.module or "")
            for alias in n.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(n, ast.Import):
            found.update(alias.name for alias in n.names)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_circle() -> None:
    graph = _graph()
    edges = {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                circles.append(path[path.index(w) :] + [w])
            elif w not in state:
                visit(w)
        path.pop()
        state[v] = 2

    for v in sorted(edges):
        if v not in state:
            visit(v)
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_compat_imports_nothing_of_the_runtime_and_the_server_side_stays_apart() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("fsdp_sync.compat"):
            bad = {d for d in deps if d.startswith("fsdp_sync") and not d.startswith("fsdp_sync.compat")}
            assert not bad, f"{name} imports {bad}"
        if name.startswith("fsdp_sync.transfer"):
            bad = {d for d in deps if d.startswith(("fsdp_sync.gather", "fsdp_sync.mixin", "trl"))}
            assert not bad, f"{name} imports {bad}"


def test_the_imports_inside_functions_are_read() -> None:
    """The reader sees an import made inside a function (the gloo backend imports the codec lazily)."""
    known = _modules()
    worker = "fsdp_sync.transfer.gloo_worker"
    assert "fsdp_sync.patch_codec" in _imports(worker, known[worker], known)


def test_writers_and_transfer_import_nothing_of_the_sync() -> None:
    """No arrow runs back up from the engine side to the sync that drives it."""
    bad = {
        name: sorted(d for d in deps if d.startswith("fsdp_sync.sync"))
        for name, deps in _graph().items()
        if name.startswith(("fsdp_sync.writers", "fsdp_sync.transfer"))
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_pipeline_imports_no_mode_and_the_mixin_no_sync_kind() -> None:
    """`WeightSync` knows the order of a sync's steps, never its modes (the policies are built where the sync is
    assembled); the mixin drives every sync kind through `sync.contract.Sync` (it never asks which kind it holds);
    the trainer seams are handed what they need and import no mixin."""
    graph = _graph()
    modes = ("fsdp_sync.sync.delta", "fsdp_sync.sync.sparse", "fsdp_sync.sync.adapter")
    assert not {d for d in graph["fsdp_sync.sync.pipeline"] if d.startswith(modes)}, graph["fsdp_sync.sync.pipeline"]
    kinds = ("fsdp_sync.sync.pipeline", "fsdp_sync.sync.adapter")
    assert not {d for d in graph["fsdp_sync.mixin"] if d.startswith(kinds)}, graph["fsdp_sync.mixin"]
    seams = {name: deps for name, deps in graph.items() if name.startswith("fsdp_sync.trainers")}
    assert seams and not {n: d for n, d in seams.items() if any(x.startswith("fsdp_sync.mixin") for x in d)}
