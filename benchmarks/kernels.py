"""The sync's GPU kernels alone against their floors, side by side in one run: the delta check over the weights a
LoRA q/v delta sync skips, and sparse extraction at 1-3% of engine-dtype values changed.

Floors at the copy rate measured in the same run (`delta._copy_rate`: bytes read plus written per second by one
device-to-device copy): the check reads each watched byte once (bytes / rate); extraction reads the new values and the
snapshot once (4 bytes an element from bfloat16 shards, 6 from float32 ones, cast on the way; the changes it writes
are left out of the floor).

Methods, interleaved: the check as a sync runs it (`DeltaTracker.changed`: the kernel's one launch, the comparison
on the device, one read-back) and the torch reference one tensor at a time (what runs without Triton);
extraction through `Snapshot.diff` with the kernels (two launches) and the torch path (one piece at a time). The
first repetition's patches and snapshots of both are compared bit for bit (`equal`). Tensors have a Qwen2 model's
names and shapes (built on the meta device, filled at random on the device). On CPU ranks (a smoke test of this
code, tiny shapes) the kernel rows run only under `TRITON_INTERPRET=1`. With `--sweep`, extraction also runs at each
launch shape of `SWEEP` (elements and warps per program), each compared with the torch path at every step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SHARES = (0.01, 0.02, 0.03)
_INT = {2: torch.int16, 4: torch.int32}


def _shapes(model_name: str) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import config_for

    from .shapes import GPU_SHAPES

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_for(GPU_SHAPES[model_name]), dtype=torch.bfloat16)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def _check_rows(model_name: str, shapes: dict[str, tuple[int, ...]], reps: int, device: torch.device,
                rate: float | None) -> list[dict[str, Any]]:  # fmt: skip
    """The delta check over what a LoRA q/v delta sync skips (everything but each layer's q, k and v)."""
    from fsdp_sync.compat.engine_api import EngineNaming
    from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
    from fsdp_sync.sync.delta import DeltaTracker, EngineGroups
    from fsdp_sync.sync.fingerprint import _fingerprint

    from .buffers import VLLM_PACKED, _fused_name

    weights = {n: _random(s, torch.bfloat16, device, k) for k, (n, s) in enumerate(shapes.items())}
    planned = [PlannedTensor(n, TensorSpec(s, torch.bfloat16), (n,)) for n, s in shapes.items()]
    trainable = frozenset(n for n in shapes if any(f".{p}." in n for p in ("q_proj", "v_proj")))
    modules = {_fused_name(n)[0].rpartition(".")[0] for n in shapes}
    tracker = DeltaTracker(planned, trainable, frozenset(), EngineGroups(EngineNaming(VLLM_PACKED), modules))
    watched = [(n, weights[n]) for n in tracker.watched]
    nbytes = sum(t.numel() * t.element_size() for _, t in watched)
    tracker.record(watched)
    reference = torch.stack([_fingerprint(t) for _, t in watched])

    def torch_check() -> list[str]:
        now = torch.stack([_fingerprint(t) for _, t in watched])
        return [n for (n, _), d in zip(watched, (now != reference).any(dim=1).tolist(), strict=True) if d]

    from fsdp_sync.kernels import runtime

    methods: dict[str, Callable[[], list[str]]] = {"torch": torch_check}
    if runtime.usable(device):
        methods["kernel"] = lambda: tracker.changed(watched)
    rows = []
    for rep in range(reps + 1):  # the first is a warm-up (compilation)
        for method in (list(methods) if rep % 2 else list(methods)[::-1]):
            seconds, changed = _timed(methods[method], device)
            assert changed == [], f"{method}: nothing changed, yet {changed[:3]}"
            if rep:
                rows.append({"model": model_name, "what": "check", "dtype": "bfloat16", "share": None,
                             "method": method, "seconds": seconds, "tensors": len(watched), "bytes": nbytes,
                             "floor_seconds": nbytes / rate if rate else None})  # fmt: skip
    return rows


def _extract_rows(model_name: str, shapes: dict[str, tuple[int, ...]], source: torch.dtype, reps: int,
                  device: torch.device, rate: float | None) -> list[dict[str, Any]]:  # fmt: skip
    """Sparse extraction of every tensor at each share of changed values, kernel and torch path side by side."""
    from fsdp_sync.kernels import runtime
    from fsdp_sync.gather.base import Piece
    from fsdp_sync.sync.sparse import Snapshot

    values = {n: _random(s, source, device, k).reshape(-1) for k, (n, s) in enumerate(shapes.items())}
    pieces = [Piece(n, v, 0) for n, v in values.items()]
    numel = sum(v.numel() for v in values.values())
    snapshots = {"kernel": Snapshot(torch.bfloat16), "torch": Snapshot(torch.bfloat16)}
    for snapshot in snapshots.values():
        snapshot.take(pieces)
    kernels = runtime.usable(device)
    rows = []
    generator = torch.Generator(device=device).manual_seed(1)
    for share in SHARES:
        for rep in range(reps + 1):  # the first is a warm-up (compilation)
            for v in values.values():  # an optimizer step's worth of changes, outside the timing
                hit = torch.rand(v.numel(), generator=generator, device=device) < share
                v[hit] = (v[hit].float() * 1.5 + 0.25).to(source)
            patches = {}
            for method in (("kernel", "torch") if rep % 2 else ("torch", "kernel")):
                if method == "kernel" and not kernels:
                    continue
                snapshot = snapshots[method]
                seconds, patches[method] = _timed(lambda s=snapshot, m=method: _diff(s, pieces, m), device)
                if rep:
                    rows.append({"model": model_name, "what": "extract", "dtype": str(source).removeprefix("torch."),
                                 "share": share, "method": method, "seconds": seconds, "tensors": len(pieces),
                                 "bytes": numel * (source.itemsize + 2),
                                 "changed": sum(p.count for p in patches[method].values()),
                                 "floor_seconds": numel * (source.itemsize + 2) / rate if rate else None})  # fmt: skip
            if rep == 0 and len(patches) == 2:
                equal = _same(patches["kernel"], patches["torch"]) and all(
                    torch.equal(_bits(snapshots["kernel"]._held[n][1]), _bits(snapshots["torch"]._held[n][1]))
                    for n in values
                )  # fmt: skip
                rows.append({"model": model_name, "what": "extract-equal", "share": share, "equal": equal,
                             "dtype": str(source).removeprefix("torch.")})  # fmt: skip
                assert equal, f"{model_name} {source} {share}: the kernel's patches differ from the torch path's"
    return rows


def _diff(snapshot: Any, pieces: list[Any], method: str) -> Any:
    if method == "kernel":
        return snapshot.diff(pieces)
    # The torch path, one piece at a time: what `Snapshot.diff` runs where the kernels do not.
    return {p.name: snapshot._diff_one(p, *snapshot._held[p.name]) for p in pieces}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].indices, b[n].indices) and torch.equal(_bits(a[n].values), _bits(b[n].values)) for n in a
    )


def _fits(shapes: dict[str, tuple[int, ...]], source: torch.dtype, device: torch.device) -> bool:
    """Whether the extraction rows fit on the device: the sources, two snapshots, both methods' patches, and the
    temporaries of the largest tensor (its random mask, the torch path's cast)."""
    if device.type != "cuda":
        return True
    sizes = [torch.Size(s).numel() for s in shapes.values()]
    numel = sum(sizes)
    need = numel * (source.itemsize + 2 * 2) + max(SHARES) * numel * 2 * 10 + max(sizes) * 12
    free, _ = torch.cuda.mem_get_info(device)
    return need < 0.85 * free


def device_and_rate() -> tuple[torch.device, float | None]:
    """The device the kernels run on and its copy rate (None on the CPU), measured once for every row of a run."""
    from .delta import _copy_rate

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, _copy_rate(device)


def kernels_rows(models: list[str], sources: list[torch.dtype], reps: int,
                 measured: tuple[torch.device, float | None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    device, rate = measured or device_and_rate()
    rows: list[dict[str, Any]] = []
    for model_name in models:
        shapes = _shapes(model_name)
        rows += _check_rows(model_name, shapes, reps, device, rate)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for source in sources:
            if not _fits(shapes, source, device):
                rows.append({"model": model_name, "what": "extract-skipped", "dtype": str(source)})
                continue
            rows += _extract_rows(model_name, shapes, source, reps, device, rate)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def kernels_table(rows: list[dict[str, Any]]) -> str:
    """Per model, kernel, source dtype and share: median ms of each method, the floor and the ratio."""
    timed = [r for r in rows if "seconds" in r and r["what"] != "extract-sweep"]
    keys = sorted({(r["model"], r["what"], r["dtype"], r["share"] or 0.0) for r in timed})
    lines = [
        "| model | what | source | changed | method | tensors | GB read | median ms | floor ms | x floor | "
        "torch / kernel |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, what, dtype, share in keys:
        mine = [r for r in timed if (r["model"], r["what"], r["dtype"], r["share"] or 0.0) == (model, what, dtype,
                                                                                                 share)]  # fmt: skip
        medians = {m: statistics.median(r["seconds"] for r in mine if r["method"] == m)
                   for m in sorted({r["method"] for r in mine})}  # fmt: skip
        for method, seconds in medians.items():
            first = next(r for r in mine if r["method"] == method)
            floor = first["floor_seconds"]
            changed = statistics.median(r["changed"] for r in mine if r["method"] == method) if what == "extract" \
                else None  # fmt: skip
            share_text = f"{changed / (first['bytes'] / (2 + (4 if dtype == 'float32' else 2))):.2%}" \
                if changed is not None else ""  # fmt: skip
            speedup = medians.get("torch", 0) / seconds if method == "kernel" and "torch" in medians else None
            lines.append(
                f"| {model} | {what} | {dtype} | {share_text} | {method} | {first['tensors']} | "
                f"{first['bytes'] / 1e9:.2f} | {seconds * 1e3:.2f} | {f'{floor * 1e3:.2f}' if floor else 'n/a'} | "
                f"{f'{seconds / floor:.2f}' if floor else 'n/a'} | {f'{speedup:.2f}' if speedup else ''} |"
            )
    notes = [f"- {r['model']} {r['dtype']}: extraction not run, the device has too little free memory"
             for r in rows if r["what"] == "extract-skipped"]  # fmt: skip
    notes += [f"- {r['model']} {r['dtype']} at {r['share']:.0%}: kernel and torch path gave "
              f"{'the same patches and snapshots, bit for bit' if r['equal'] else 'DIFFERENT results'}"
              for r in rows if r["what"] == "extract-equal"]  # fmt: skip
    swept = [r for r in rows if r["what"] == "extract-sweep"]
    sweep = ["", "Sparse extraction (bfloat16) at each launch shape, compared with the torch path at every step:", "",
             sweep_table(swept)] if swept else []  # fmt: skip
    return "\n".join(lines + ([""] + notes if notes else []) + sweep)


# The extraction's launch shapes tried by `sweep_rows`: (elements per program, warps per program).
SWEEP = ((512, 2), (512, 4), (1024, 2), (1024, 4), (2048, 4), (4096, 4), (4096, 8))


def sweep_rows(models: list[str], reps: int, measured: tuple[torch.device, float | None] | None = None,
               share: float = 0.02) -> list[dict[str, Any]]:  # fmt: skip
    """Sparse extraction (bfloat16 sources, `share` changed) with each launch shape of `SWEEP`, the torch path run
    after each timed call on its own snapshot of the same steps, compared with it bit for bit at every step.

    Why every step is a fresh optimizer step's worth of changes: a shape timed after another would otherwise find
    nothing changed (the first call wrote the changes into the snapshot).
    """
    from fsdp_sync.gather.base import Piece
    from fsdp_sync.kernels.extract import Extractor, kind_of
    from fsdp_sync.sync.sparse import Snapshot

    device, rate = measured or device_and_rate()
    rows: list[dict[str, Any]] = []
    for model_name in models:
        shapes = _shapes(model_name)
        values = {n: _random(s, torch.bfloat16, device, k).reshape(-1) for k, (n, s) in enumerate(shapes.items())}
        pieces = [Piece(n, v, 0) for n, v in values.items()]
        numel = sum(v.numel() for v in values.values())
        kernel, reference = Snapshot(torch.bfloat16), Snapshot(torch.bfloat16)
        kernel.take(pieces)
        reference.take(pieces)
        first = next(iter(kernel._held.values()))[1]
        kind = kind_of(pieces[0].values, first)
        generator = torch.Generator(device=device).manual_seed(2)
        # One extractor per shape, kept over the steps (its table and scratch size, as in a sync).
        extractors = {(chunk, warps): Extractor(kind, chunk=chunk, warps=warps) for chunk, warps in SWEEP}
        for rep in range(reps + 1):  # the first is a warm-up (compilation)
            for chunk, warps in (SWEEP if rep % 2 else SWEEP[::-1]):
                for v in values.values():
                    hit = torch.rand(v.numel(), generator=generator, device=device) < share
                    v[hit] = (v[hit].float() * 1.5 + 0.25).to(torch.bfloat16)
                kernel._extractors = {(kind, first.device): extractors[(chunk, warps)]}
                seconds, got = _timed(lambda: kernel.diff(pieces), device)
                want = _diff(reference, pieces, "torch")
                equal = _same(got, want)
                assert equal, f"{model_name} chunk {chunk} warps {warps}: the patches differ from the torch path's"
                if rep:
                    rows.append({"model": model_name, "what": "extract-sweep", "chunk": chunk, "warps": warps,
                                 "seconds": seconds, "bytes": numel * 4,
                                 "floor_seconds": numel * 4 / rate if rate else None,
                                 "changed": sum(p.count for p in got.values()), "equal": equal})  # fmt: skip
        same_snapshot = all(torch.equal(_bits(kernel._held[n][1]), _bits(reference._held[n][1])) for n in values)
        assert same_snapshot, f"{model_name}: the snapshots differ after the sweep"
        del values, pieces, kernel, reference, first, extractors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """Per model and launch shape: median ms, the floor, the ratio."""
    lines = ["| model | elements per program | warps | median ms | floor ms | x floor | changed |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key in sorted({(r["model"], r["chunk"], r["warps"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["chunk"], r["warps"]) == key]
        seconds = statistics.median(r["seconds"] for r in mine)
        floor = mine[0]["floor_seconds"]
        share = statistics.median(r["changed"] for r in mine) / (mine[0]["bytes"] / 4)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {seconds * 1e3:.2f} | "
                     f"{f'{floor * 1e3:.2f}' if floor else 'n/a'} | {f'{seconds / floor:.2f}' if floor else 'n/a'} | "
                     f"{share:.2%} |")  # fmt: skip
    return "\n".join(lines)
