"""What one sync did: time, bytes, throughput, peak extra memory; as a record and as trainer metrics.

The figures every sync has live on `SyncReport` itself; each mode adds its own typed figures (`DeltaFigures`,
`SparseFigures`, `AdapterFigures`), which its selection policy makes (`SelectionPolicy.report`), so the pipeline that
builds the report knows no mode. A mode's figures are read through their type (`report.figure(SparseFigures)`, None
where the sync ran in another mode); what every sync has an answer to (`complete`, `sparse`) is a property of the
report; `as_dict` holds every mode's figures flat, at their defaults where the mode did not run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, TypeVar

__all__ = ["AdapterFigures", "DeltaFigures", "Figures", "SparseFigures", "SyncReport"]


class Figures(Protocol):
    """One mode's figures of one sync."""

    def metrics(self, prefix: str) -> dict[str, float]:
        """Scalar metrics for the trainer's logs, beyond the report's own."""
        ...

    def summary(self) -> str:
        """A few words for the report's one-line summary ("" for none)."""
        ...


@dataclass(frozen=True)
class DeltaFigures:
    """A delta sync (`SyncConfig.delta`).

    Attributes:
        complete: every planned tensor was sent.
        skipped_tensors, skipped_bytes: planned tensors not sent, and their bytes on the wire.
        changed_skipped: skipped weights found changed by the delta check (sent, and logged by name).
        check_seconds: time of the delta check (fingerprints of the skipped weights and the agreement; not in
            `seconds`).
    """

    complete: bool = True
    skipped_tensors: int = 0
    skipped_bytes: int = 0
    changed_skipped: int = 0
    check_seconds: float = 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        return {}

    def summary(self) -> str:
        if self.complete:
            return ""
        return (
            f" (delta: {self.skipped_tensors} tensors, {self.skipped_bytes / 1e6:.2f} MB skipped, checked in "
            f"{self.check_seconds * 1e3:.1f} ms)"
        )


@dataclass(frozen=True)
class SparseFigures:
    """A sync under `SyncConfig.sparse`; where it sent patches, the report's `tensors` and `bytes` are what went whole.

    Attributes:
        patched: the sync sent patches (a dense sync of the sparse mode has its snapshot figures only).
        patched_tensors, patched_elements: the tensors sent as patches and their elements in all.
        diffed_elements: the elements compared with the snapshot (the patched tensors, and those that then went
            whole: their engine module changed more than `SyncConfig.sparse_max_density`).
        changed_elements: the elements among them that changed (those of the patched tensors sent as (index, value)).
        patch_bytes: bytes of the patches on the wire (the trainer's patch collectives, as one rank receives them).
        encoded_bytes: the patches as an engine receives them, one whole copy (`fsdp_sync.patch_codec`'s segments):
            what a broadcast sends every server worker; a routed push sends each worker the part inside its cut.
        snapshot_bytes: this rank's sparse snapshot (its shards as last pushed, in the engine dtype).
        snapshot_seconds: time to take the snapshot after a dense sync (not in `seconds`).
        patch_seconds: the trainer side: the diff, the counts and the patch collectives (in `seconds`).
    """

    patched: bool = False
    patched_tensors: int = 0
    patched_elements: int = 0
    diffed_elements: int = 0
    changed_elements: int = 0
    patch_bytes: int = 0
    encoded_bytes: int = 0
    snapshot_bytes: int = 0
    snapshot_seconds: float = 0.0
    patch_seconds: float = 0.0

    @property
    def changed_fraction(self) -> float:
        """Of the elements diffed, the fraction that changed (0 for a sync without a diff)."""
        return self.changed_elements / self.diffed_elements if self.diffed_elements else 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        if not self.patched:
            return {}
        return {
            f"{prefix}changed_fraction": self.changed_fraction,
            f"{prefix}patch_gbytes": self.patch_bytes / 1e9,
            f"{prefix}patched_tensors": float(self.patched_tensors),
        }

    def summary(self) -> str:
        if not self.patched:
            return ""
        return (
            f", sparse: {self.patched_tensors} tensors as patches ({self.changed_fraction:.2%} changed, "
            f"{self.patch_bytes / 1e6:.2f} MB)"
        )


@dataclass(frozen=True)
class AdapterFigures:
    """An adapter sync (`SyncConfig.adapter`): only the LoRA tensors went, into the engine's LoRA manager.

    Attributes:
        adapter_id: the engine's id of the adapter this sync loaded (generation asks for it from now on).
        adapter_tensors: the LoRA tensors sent (`lora_A` and `lora_B` per target module).
        base_checked_seconds: time of the one-time digest check of the engine's base (0 after the first sync).
    """

    adapter_id: int = 0
    adapter_tensors: int = 0
    base_checked_seconds: float = 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}adapter_id": float(self.adapter_id)}

    def summary(self) -> str:
        return f" (adapter {self.adapter_id}: {self.adapter_tensors} LoRA tensors, base untouched)"


# Every mode's figures, in the order `SyncReport.as_dict` lists them (at their defaults where the mode did not run).
_KINDS: tuple[type[DeltaFigures | SparseFigures | AdapterFigures], ...] = (DeltaFigures, SparseFigures, AdapterFigures)

_F = TypeVar("_F", bound=Figures)


@dataclass(frozen=True)
class SyncReport:
    """Figures of one sync on this rank.

    Attributes:
        seconds: wall time from the first gather to the end of the push (device work included).
        bytes: bytes pushed into the engine (in the engine's dtype).
        tensors: number of tensors pushed.
        peak_extra_bytes: peak memory the sync added on this rank (see `memory_source`).
        memory_source: `"cuda_allocator"` (measured) or `"accounted"` (sum of the full tensors the sync held).
        backend, strategy, writer: what ran.
        ok: False for a sync that failed (its figures are zero; `error` says why, `engine` what the engine holds).
        engine: this rank's engine after the sync: `"current"`, or after a failure `"unchanged"`, `"mixed"`,
            `"undefined"`, `"replaced"`, `"unknown"` (see `fsdp_sync.errors.EngineState`); `"none"` on a rank that
            writes into no engine (server mode: the main process sends, and its report says what the server holds).
        error: the error every rank raised, for a failed sync.
        verified: with `SyncConfig(verify=True)`: engine weights whose digest matched what was sent.
        unverifiable: with `verify`: engine weights that could not be compared (named in the logs).
        verify_seconds: with `verify`: time spent on digests, trainer and engine side (not in `seconds`).
        figures: the mode's own figures (`DeltaFigures`, `SparseFigures`, `AdapterFigures`), read with `figure`.
        sent_bytes: bytes this rank put on the transfer's wire (a server writer's: its share of a routed push, where
            every rank sends; the whole stream where only rank 0 does); None where the writer does not count them.
        worker_bytes: of `sent_bytes`, what each server worker received from this rank, in worker order (a
            broadcast's: every byte to every worker; a routed push's: that worker's cut); empty where not counted.
    """

    seconds: float
    bytes: int
    tensors: int
    peak_extra_bytes: int
    memory_source: str
    backend: str
    strategy: str
    writer: str
    ok: bool = True
    engine: str = "current"
    error: str | None = None
    verified: int | None = None
    unverifiable: int | None = None
    verify_seconds: float = 0.0
    figures: tuple[Figures, ...] = ()
    sent_bytes: int | None = None
    worker_bytes: tuple[int, ...] = ()

    @classmethod
    def failed(cls, error: BaseException, engine: str, *, backend: str, strategy: str, writer: str) -> SyncReport:
        """The record of a sync that raised."""
        return cls(0.0, 0, 0, 0, "", backend, strategy, writer, ok=False, engine=engine, error=f"{type(error).__name__}: {error}")

    def figure(self, kind: type[_F]) -> _F | None:
        """This report's figures of type `kind`, or None where the sync ran in another mode."""
        return next((f for f in self.figures if isinstance(f, kind)), None)

    @property
    def complete(self) -> bool:
        """Every planned tensor was sent (False only for a delta sync that skipped some)."""
        delta = self.figure(DeltaFigures)
        return delta.complete if delta is not None else True

    @property
    def sparse(self) -> bool:
        """The sync sent patches (`SyncConfig.sparse`)."""
        sparse = self.figure(SparseFigures)
        return sparse is not None and sparse.patched

    @property
    def changed_fraction(self) -> float:
        """Of the elements diffed, the fraction that changed (0 for a sync without a diff)."""
        sparse = self.figure(SparseFigures)
        return sparse.changed_fraction if sparse is not None else 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of pushed bytes."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Scalar metrics for the trainer's logs (TensorBoard, W&B)."""
        if not self.ok:
            return {f"{prefix}failed": 1.0}
        delta = self.figure(DeltaFigures) or DeltaFigures()  # every sync logs what it skipped (nothing outside delta)
        metrics = {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbytes": self.bytes / 1e9,
            f"{prefix}gbps": self.gbps,
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}peak_extra_gbytes": self.peak_extra_bytes / 1e9,
            f"{prefix}failed": 0.0,
            f"{prefix}skipped_tensors": float(delta.skipped_tensors),
            f"{prefix}skipped_gbytes": delta.skipped_bytes / 1e9,
        }
        for figures in self.figures:
            metrics.update(figures.metrics(prefix))
        if self.sent_bytes is not None:
            metrics[f"{prefix}sent_gbytes"] = self.sent_bytes / 1e9
        if self.verified is not None:
            metrics[f"{prefix}verify_seconds"] = self.verify_seconds
            metrics[f"{prefix}unverifiable"] = float(self.unverifiable or 0)
        return metrics

    def summary(self) -> str:
        if not self.ok:
            return f"weight sync [{self.backend}/{self.strategy} -> {self.writer}] FAILED; engine {self.engine}: {self.error}"
        extra = "".join(f.summary() for f in self.figures)
        return (
            f"weight sync [{self.backend}/{self.strategy} -> {self.writer}]: {self.tensors} tensors{extra}, "
            f"{self.bytes / 1e6:.2f} MB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s), "
            f"peak extra {self.peak_extra_bytes / 1e6:.2f} MB ({self.memory_source})"
        )

    def as_dict(self) -> dict[str, object]:
        """Every figure flat, each mode's included (at its default where it did not run)."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "figures"}
        for kind in _KINDS:
            figures = self.figure(kind) or kind()
            record.update({f.name: getattr(figures, f.name) for f in fields(figures)})
        return {**record, "sparse": self.sparse, "gbps": self.gbps, "changed_fraction": self.changed_fraction}
