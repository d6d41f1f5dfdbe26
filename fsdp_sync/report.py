"""What one sync did: time, bytes, throughput, peak extra memory; as a record and as trainer metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SyncReport"]


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
            `"undefined"`, `"replaced"`, `"unknown"` (see `fsdp_sync.errors.EngineState`).
        error: the error every rank raised, for a failed sync.
        verified: with `SyncConfig(verify=True)`: engine weights whose digest matched what was sent.
        unverifiable: with `verify`: engine weights that could not be compared (named in the logs).
        verify_seconds: with `verify`: time spent on digests, trainer and engine side (not in `seconds`).
        complete: every planned tensor was sent (False: a delta sync, `SyncConfig.delta`).
        skipped_tensors, skipped_bytes: planned tensors a delta sync did not send, and their bytes on the wire.
        changed_skipped: skipped weights found changed by the delta check (sent, and logged by name).
        check_seconds: time of the delta check (fingerprints of the skipped weights and the agreement; not in
            `seconds`).
        sparse: the sync sent patches (`SyncConfig.sparse`); `tensors` and `bytes` are then what went whole.
        patched_tensors, patched_elements: the tensors sent as patches and their elements in all.
        diffed_elements: the elements compared with the snapshot (the patched tensors, and those that then went
            whole: their engine module changed more than `SyncConfig.sparse_max_density`).
        changed_elements: the elements among them that changed (those of the patched tensors sent as (index, value)).
        patch_bytes: bytes of the patches on the wire (the trainer's patch collectives, as one rank receives them).
        snapshot_bytes: this rank's sparse snapshot (its shards as last pushed, in the engine dtype).
        snapshot_seconds: time to take the snapshot after a dense sync (not in `seconds`).
        patch_seconds: the trainer side of a sparse sync: the diff, the counts and the patch collectives (in
            `seconds`).
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
    complete: bool = True
    skipped_tensors: int = 0
    skipped_bytes: int = 0
    changed_skipped: int = 0
    check_seconds: float = 0.0
    sparse: bool = False
    patched_tensors: int = 0
    patched_elements: int = 0
    diffed_elements: int = 0
    changed_elements: int = 0
    patch_bytes: int = 0
    snapshot_bytes: int = 0
    snapshot_seconds: float = 0.0
    patch_seconds: float = 0.0

    @classmethod
    def failed(cls, error: BaseException, engine: str, *, backend: str, strategy: str, writer: str) -> SyncReport:
        """The record of a sync that raised."""
        return cls(0.0, 0, 0, 0, "", backend, strategy, writer, ok=False, engine=engine, error=f"{type(error).__name__}: {error}")

    @property
    def changed_fraction(self) -> float:
        """Of the elements diffed, the fraction that changed (0 for a sync without a diff)."""
        return self.changed_elements / self.diffed_elements if self.diffed_elements else 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of pushed bytes."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Scalar metrics for the trainer's logs (TensorBoard, W&B)."""
        if not self.ok:
            return {f"{prefix}failed": 1.0}
        metrics = {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbytes": self.bytes / 1e9,
            f"{prefix}gbps": self.gbps,
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}peak_extra_gbytes": self.peak_extra_bytes / 1e9,
            f"{prefix}failed": 0.0,
            f"{prefix}skipped_tensors": float(self.skipped_tensors),
            f"{prefix}skipped_gbytes": self.skipped_bytes / 1e9,
        }
        if self.sparse:
            metrics[f"{prefix}changed_fraction"] = self.changed_fraction
            metrics[f"{prefix}patch_gbytes"] = self.patch_bytes / 1e9
            metrics[f"{prefix}patched_tensors"] = float(self.patched_tensors)
        if self.verified is not None:
            metrics[f"{prefix}verify_seconds"] = self.verify_seconds
            metrics[f"{prefix}unverifiable"] = float(self.unverifiable or 0)
        return metrics

    def summary(self) -> str:
        if not self.ok:
            return f"weight sync [{self.backend}/{self.strategy} -> {self.writer}] FAILED; engine {self.engine}: {self.error}"
        skipped = (
            f" (delta: {self.skipped_tensors} tensors, {self.skipped_bytes / 1e6:.2f} MB skipped, checked in "
            f"{self.check_seconds * 1e3:.1f} ms)" if not self.complete else ""
        )
        if self.sparse:
            skipped += (
                f", sparse: {self.patched_tensors} tensors as patches ({self.changed_fraction:.2%} changed, "
                f"{self.patch_bytes / 1e6:.2f} MB)"
            )
        return (
            f"weight sync [{self.backend}/{self.strategy} -> {self.writer}]: {self.tensors} tensors{skipped}, "
            f"{self.bytes / 1e6:.2f} MB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s), "
            f"peak extra {self.peak_extra_bytes / 1e6:.2f} MB ({self.memory_source})"
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "gbps": self.gbps, "changed_fraction": self.changed_fraction}
