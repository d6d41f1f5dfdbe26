"""Adapter syncs on the GPU beside merged ones, per sync, in one run: time, bytes, peak memory, and the adapter's floor.

A LoRA adapter (r=16, alpha 32, in the base dtype) on q_proj/v_proj, or on every linear layer, of a Qwen2-shaped bf16
model wrapped with FSDP1 or FSDP2 (one unit per decoder layer, plus the root), one NCCL process per GPU. The engine
is a stand-in (vLLM does not run on that machine's image), as in the other GPU rows: engine-layout base buffers
(`buffers.FusedBuffersWriter`, batched copies) and, for the adapter, vLLM's LoRA manager's slots on the GPU
(`LoRABuffersWriter`: per LoRA module of the engine and packed part, one `lora_a` slot of max_rank x in and one
`lora_b` slot of out x max_rank, the adapter's scaling folded into `lora_b` as vLLM folds it).

Methods, interleaved, on the same wrapped model and engine: `merged-complete` (SyncConfig(adapter=False, delta=False):
the adapter merged into its base weights, every engine tensor pushed), `merged-delta` (SyncConfig(adapter=False): what
can change, with the check of the skipped weights), `adapter` (SyncConfig(adapter=True): only lora_A/lora_B, into the
LoRA slots). Between repetitions the adapters change (every LoRA weight scaled, as an optimizer step would change it).
After the timed repetitions each method syncs once more and the engine is compared with the trainer's full weights
bit for bit (`_exact`): the LoRA slots with lora_A and scaling x lora_B, the base buffers with PEFT's merge
(W + (B @ A) x scaling, in the weights' dtype, as PEFT merges).

Floor of the adapter sync: one device-to-device copy of the adapter's bytes at the copy rate measured in the same run
(`delta._copy_rate`: 2 x bytes / rate).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .buffers import FusedBuffersWriter
from .common import Measurement, measure
from .delta import TARGETS, _base_model, _copy_rate, _peft_model, _step, _wrap

__all__ = ["LoRABuffersWriter", "adapter_gpu_table", "adapter_gpu_worker"]

# vLLM's LoRA modules of a Llama/Qwen2-family model, packed parts unfolded (what its LoRA manager allocates slots for).
_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 16


class LoRABuffersWriter(FusedBuffersWriter):
    """Engine-layout base buffers plus LoRA slots on the device: merged syncs write the base buffers, an adapter sync
    (`fsdp_sync.writers.base.AdapterWriter`) writes the slots.

    Why slots: vLLM's LoRA manager keeps each served adapter in preallocated stacked buffers per LoRA module (one per
    packed part: `qkv_proj` has three), `lora_a` of max_rank x in, `lora_b` of out x max_rank, and folds the scaling
    into `lora_b`; an adapter loaded in memory ends up copied there. This stand-in writes them batched (one
    `_foreach_copy_` for all `lora_a`, one for all `lora_b`, one `_foreach_mul_` for the scaling).

    Args:
        checkpoint: the directory the engine loaded its base from (checked once by the adapter sync).
    """

    def __init__(self, specs: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device, checkpoint: str,
                 copies: str = "batched") -> None:  # fmt: skip
        super().__init__(dict(specs), dtype=dtype, device=device, copies=copies)
        self.checkpoint = checkpoint
        self.lora_a: dict[str, torch.Tensor] = {}  # checkpoint module name (`model.layers.0.self_attn.q_proj`)
        self.lora_b: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module.rpartition(".")[2] in _LORA_MODULES:
                out_features, in_features = spec.shape
                self.lora_a[module] = torch.zeros(MAX_RANK, in_features, dtype=dtype, device=device)
                self.lora_b[module] = torch.zeros(out_features, MAX_RANK, dtype=dtype, device=device)
        self._loaded: tuple[int, str] | None = None
        self._targeted: frozenset[str] = frozenset()
        self._rank = 0
        self._slots: dict[tuple[tuple[str, ...], int], tuple[list, list[int], list, list[int], frozenset[str]]] = {}

    def lora_limits(self):  # type: ignore[no-untyped-def]
        from fsdp_sync.compat.lora_api import LoRALimits

        return LoRALimits(MAX_RANK, frozenset(_LORA_MODULES), self.engine_dtype)

    def adapter_transport_refusal(self) -> str | None:
        return None  # in-process buffers: nothing to carry

    def base_checkpoint(self) -> str:
        return self.checkpoint

    def load_adapter(self, adapter: Any) -> None:
        """Copy the adapter's tensors into their slots (the scaling folded into `lora_b`).

        NOTE: the slots each adapter name goes to are worked out once per layout (names and rank), as vLLM's manager
        allocates its slots once: a sync then costs the three batched calls."""
        r = int(adapter.config["r"])
        scaling = float(adapter.config["lora_alpha"]) / r
        names = tuple(adapter.tensors)
        slots = self._slots.get((names, r))
        if slots is None:
            slots = self._slots[(names, r)] = self._slots_of(names, r)
        a_slots, a_at, b_slots, b_at, targeted = slots
        if targeted != self._targeted:
            # NOTE: the slots of modules this adapter does not target read zero (vLLM resets them); they stay zero
            # while the targets do not change, so they are cleared only when they do.
            others = [t for m in self.lora_a.keys() - targeted for t in (self.lora_a[m], self.lora_b[m])]
            if others:
                torch._foreach_zero_(others)
            self._targeted = targeted
        values = list(adapter.tensors.values())
        torch._foreach_copy_(a_slots, [values[i] for i in a_at])
        torch._foreach_copy_(b_slots, [values[i] for i in b_at])
        torch._foreach_mul_(b_slots, scaling)
        self._loaded = (adapter.adapter_id, adapter.name)
        self._rank = r

    def _slots_of(self, names: tuple[str, ...], r: int) -> tuple[list, list[int], list, list[int], frozenset[str]]:
        """(`lora_a` slots, the positions of their tensors in `names`, `lora_b` slots, theirs, the targeted modules)."""
        a_slots, a_at, b_slots, b_at = [], [], [], []
        for i, name in enumerate(names):
            module, which = _module_of(name)
            if which == "lora_A":
                a_slots.append(self.lora_a[module][:r])
                a_at.append(i)
            else:
                b_slots.append(self.lora_b[module][:, :r])
                b_at.append(i)
        return a_slots, a_at, b_slots, b_at, frozenset(_module_of(n)[0] for n in names)

    def publish_adapter(self, adapter: Any) -> None:
        """Nothing to move: the slots hold one adapter, which the benchmark reads (no requests name it)."""

    def abandon_adapter(self) -> None:
        """Nothing to drop (the slots are rewritten whole by the next load)."""

    def adapter_request(self) -> object | None:
        return self._loaded

    def adapter_digests(self) -> tuple[dict[str, dict[str, str]], Any]:
        """The slots of the adapter loaded last, as `SyncConfig(verify=True)` reads an engine's (`lora_b` scaled)."""
        from fsdp_sync.compat.lora_api import EngineLoRA
        from fsdp_sync.digest import tensor_digest

        digests: dict[str, str] = {}
        for module in sorted(self._targeted):
            digests[f"{module}.lora_a"] = tensor_digest(self.lora_a[module][: self._rank])
            digests[f"{module}.lora_b"] = tensor_digest(self.lora_b[module][:, : self._rank])
        return {"": digests}, EngineLoRA(self.engine_dtype)

    def adapter_mismatches(self, full: Mapping[str, torch.Tensor], scaling: float) -> list[str]:
        """LoRA modules whose slots differ in any bit from the trainer's full `lora_A` and scaling x `lora_B`
        (`full`: checkpoint module name + `.lora_A` / `.lora_B` -> weight), or, where not targeted, are not zero."""
        bad = [m for m in self.lora_a.keys() - self._targeted if self.lora_a[m].any() or self.lora_b[m].any()]
        for module in self._targeted:
            a, b = full[f"{module}.lora_A"], full[f"{module}.lora_B"]
            r = a.shape[0]
            if not (torch.equal(self.lora_a[module][:r], a.to(self.engine_dtype))
                    and torch.equal(self.lora_b[module][:, :r], b.to(self.engine_dtype) * scaling)):  # fmt: skip
                bad.append(module)
        return sorted(bad)


def _module_of(peft_name: str) -> tuple[str, str]:
    """(checkpoint module name, "lora_A" or "lora_B") of a PEFT checkpoint name
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (`model.layers.0.self_attn.q_proj`,
    `lora_A`))."""
    parts = peft_name.split(".")
    which = parts[-2]
    return ".".join(parts[2:-2]), which


def _refusals_without_vllm(config: Mapping[str, Any], limits: Any, server: bool | None = None) -> list[str]:
    """vLLM's own checks of an adapter config (`PEFTHelper`), for a machine without vLLM: DoRA, LoRA bias, ranks.

    NOTE: benchmark-side only, where `vllm` cannot be imported (the GPU machine's image): the adapter sync asks vLLM's
    `PEFTHelper` before its first write (`fsdp_sync.compat.lora_api._vllm_refusals`); the adapters of this benchmark
    pass those checks on the CPU machine, where the real one runs (`adapter` part, `tests/e2e/test_adapters.py`).
    """
    reasons = []
    if config.get("use_dora"):
        reasons.append("DoRA")
    ranks = [int(config["r"]), *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > limits.max_lora_rank:
        reasons.append(f"rank {max(ranks)} is above the engine's max_lora_rank {limits.max_lora_rank}")
    if config.get("bias", "none") != "none":
        reasons.append(f"bias={config['bias']!r} (vLLM serves no adapter bias)")
    return reasons


def _without_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def adapter_gpu_worker(rank: int, world_size: int, model_name: str, reps: int) -> list[dict[str, Any]]:
    from fsdp_sync.compat import lora_api
    from fsdp_sync.compat.manifest import TensorSpec

    if _without_vllm():
        lora_api._vllm_refusals = _refusals_without_vllm  # type: ignore[assignment]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rate = _copy_rate(device)
    rows: list[dict[str, Any]] = []
    with _shared_directory(rank) as checkpoint:
        saved = False
        for targets in TARGETS:
            for backend in ("fsdp1", "fsdp2"):
                base = _base_model(model_name, None, device)
                if not saved:
                    # The engine's checkpoint: the trainer's base (seeded, the same on every rank and for every
                    # configuration), written once by rank 0 for every rank of the host.
                    if rank == 0:
                        base.save_pretrained(checkpoint, max_shard_size="100GB")
                    _barrier()
                    saved = True
                specs = {n: TensorSpec(tuple(p.shape), p.dtype) for n, p in base.named_parameters()}
                writer = LoRABuffersWriter(specs, dtype=torch.bfloat16, device=device, checkpoint=checkpoint)
                wrapped = _wrap(_peft_model(base, TARGETS[targets]), backend, device)
                rows += _measure(wrapped, writer, backend, targets, model_name, reps, rank, world_size, device, rate)
                del base, wrapped, writer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _shared_directory(rank: int) -> Iterator[str]:
    """One temporary directory for every rank of this host (made by rank 0, its name broadcast; removed by rank 0
    once every rank is done with it)."""
    import torch.distributed as dist

    made = [tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)] if rank == 0 else [None]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    try:
        yield str(made[0])
    finally:
        _barrier()
        if rank == 0:
            shutil.rmtree(str(made[0]), ignore_errors=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _measure(
    wrapped: torch.nn.Module,
    writer: LoRABuffersWriter,
    backend: str,
    targets: str,
    model_name: str,
    reps: int,
    rank: int,
    world_size: int,
    device: torch.device,
    rate: float | None,
) -> list[dict[str, Any]]:
    """The three methods on one wrapped PEFT model and engine, interleaved over `reps` repetitions."""
    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.report import DeltaFigures
    from fsdp_sync.sync.adapter import AdapterSync

    syncs = {
        "adapter": build_sync(wrapped, writer, SyncConfig(adapter=True), device=device),
        "merged-complete": build_sync(wrapped, writer, SyncConfig(adapter=False, delta=False), device=device),
        "merged-delta": build_sync(wrapped, writer, SyncConfig(adapter=False), device=device),
    }
    assert isinstance(syncs["adapter"], AdapterSync), type(syncs["adapter"])
    for sync in syncs.values():
        sync.sync()  # the adapter's base check (once); the merged syncs' first, complete ones
    check_seconds: list[float] = []

    def run(name: str) -> tuple[int, int]:
        report = syncs[name].sync()
        if name == "merged-delta":
            check_seconds.append(report.figure(DeltaFigures).check_seconds)
        return report.tensors, report.bytes

    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        order = list(syncs)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for method in order:
            _step(wrapped)
            seconds, tensors, nbytes, peak, source = measure(lambda m=method: run(m), device)
            rows.append(Measurement(model_name, backend, f"{targets}/{method}", rep, seconds, tensors, nbytes, peak,
                                    source, world_size, rank).row())  # fmt: skip
    rows.append({"model": model_name, "backend": backend, "method": f"{targets}/facts", "rank": rank,
                 "check_seconds": check_seconds, "copy_bytes_per_s": rate,
                 "exact": _exact(wrapped, writer, syncs)})  # fmt: skip
    return rows


def _exact(wrapped: torch.nn.Module, writer: LoRABuffersWriter, syncs: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per method, after one more step and its sync: the engine tensors that differ in any bit from the trainer's full
    weights (empty: exact)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_sync.compat.lora_api import peft_adapter_config

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    _, config = peft_adapter_config(wrapped.module if isinstance(wrapped, FSDP) else wrapped)
    scaling = float(config["lora_alpha"]) / int(config["r"])
    out: dict[str, list[str]] = {}
    for method, sync in syncs.items():
        _step(wrapped)
        sync.sync()
        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
        lora, base = _split(full)
        if method == "adapter":
            out[method] = writer.adapter_mismatches(lora, scaling)
        else:
            out[method] = writer.mismatches(_merged(base, lora, scaling))
        del full
    return out


def _split(full: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(checkpoint module name + `.lora_A`/`.lora_B` -> weight, checkpoint name -> base weight) of a PEFT model's full
    state dict (`base_model.model.<module>.lora_A.default.weight`, `base_model.model.<module>.base_layer.weight`)."""
    lora: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        parts = key.removeprefix("base_model.model.").split(".")
        if len(parts) > 2 and parts[-3] in ("lora_A", "lora_B"):
            lora[".".join(parts[:-3]) + "." + parts[-3]] = value
        else:
            base[".".join(p for p in parts if p != "base_layer")] = value
    return lora, base


def _merged(
    base: Mapping[str, torch.Tensor], lora: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """PEFT's merge of every adapted weight (`weight += (lora_B @ lora_A) * scaling`, in the weight's dtype).

    NOTE: as PEFT's `get_delta_weight` computes the delta: on the CPU, half-precision adapters are multiplied in
    float32 and the delta cast back (CPU matmuls in bf16 round otherwise: a reference in bf16 differed from PEFT's
    merge in a few tensors of every 2-rank CPU run, while the library, which calls PEFT's function, was right).
    """
    out = dict(base)
    for key in lora:
        module, _, which = key.rpartition(".")
        if which != "lora_A":
            continue
        b, a = lora[f"{module}.lora_B"], lora[f"{module}.lora_A"]
        if b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16):
            delta = ((b.float() @ a.float()) * scaling).to(b.dtype)
        else:
            delta = (b @ a) * scaling
        merged = base[f"{module}.weight"].clone()
        merged += delta
        out[f"{module}.weight"] = merged
    return out


def adapter_gpu_table(rows: list[dict[str, Any]]) -> str:
    """Per model, backend and adapter: median ms and MB of each method (rank 0), the adapter's floor and ratios, and
    whether every engine tensor matched bit for bit."""
    timed = [r for r in rows if "seconds" in r and r["rank"] == 0]
    facts = {(r["model"], r["backend"], r["method"].split("/")[0]): r
             for r in rows if r.get("method", "").endswith("/facts") and r["rank"] == 0}  # fmt: skip
    keys = sorted({(r["model"], r["backend"], r["method"].split("/")[0]) for r in timed})
    lines = [
        "| model | backend | LoRA on (r=16) | merged complete ms | merged delta ms | check ms | adapter ms | "
        "merged complete MB | merged delta MB | adapter MB | adapter floor ms | adapter x floor | "
        "time: delta / adapter | time: complete / adapter | adapter peak extra MB | exact |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, backend, targets in keys:
        def med(method: str, field: str = "seconds") -> float:
            key = (model, backend, f"{targets}/{method}")
            return statistics.median(r[field] for r in timed if (r["model"], r["backend"], r["method"]) == key)

        complete, delta, adapter = (med(m) for m in ("merged-complete", "merged-delta", "adapter"))
        cbytes, dbytes, abytes = (med(m, "bytes") for m in ("merged-complete", "merged-delta", "adapter"))
        fact = facts.get((model, backend, targets), {})
        check = statistics.median(fact["check_seconds"]) if fact.get("check_seconds") else math.nan
        rate = fact.get("copy_bytes_per_s")
        floor = 2 * abytes / rate if rate else None
        wrong = {m: names for m, names in (fact.get("exact") or {}).items() if names}
        exact = "yes" if fact.get("exact") and not wrong else f"NO: {wrong}"
        label = {"qv": "q_proj, v_proj", "all": "all linear"}[targets]
        lines.append(
            f"| {model} | {backend} | {label} | {complete * 1e3:.2f} | {delta * 1e3:.2f} | {check * 1e3:.2f} | "
            f"{adapter * 1e3:.2f} | {cbytes / 1e6:.1f} | {dbytes / 1e6:.1f} | {abytes / 1e6:.2f} | "
            f"{f'{floor * 1e3:.4f}' if floor else 'n/a'} | {f'{adapter / floor:.1f}' if floor else 'n/a'} | "
            f"{delta / adapter:.1f} | {complete / adapter:.1f} | {med('adapter', 'peak_extra_bytes') / 1e6:.1f} | "
            f"{exact} |"
        )
    return "\n".join(lines)
