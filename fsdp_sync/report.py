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
    """

    seconds: float
    bytes: int
    tensors: int
    peak_extra_bytes: int
    memory_source: str
    backend: str
    strategy: str
    writer: str

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of pushed bytes."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Scalar metrics for the trainer's logs (TensorBoard, W&B)."""
        return {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbytes": self.bytes / 1e9,
            f"{prefix}gbps": self.gbps,
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}peak_extra_gbytes": self.peak_extra_bytes / 1e9,
        }

    def summary(self) -> str:
        return (
            f"weight sync [{self.backend}/{self.strategy} -> {self.writer}]: {self.tensors} tensors, "
            f"{self.bytes / 1e6:.2f} MB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s), "
            f"peak extra {self.peak_extra_bytes / 1e6:.2f} MB ({self.memory_source})"
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "gbps": self.gbps}
