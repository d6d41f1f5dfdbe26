"""Opt-in runtime verification (`SyncConfig(verify=True)`): after a push, the engine's own per-parameter sha256
digests are compared with digests of exactly what was sent, computed trainer-side in the engine's layout.

Why digests: they are what vLLM itself exposes for this (`Worker.compute_weight_checksums`, the server's
`/weight_checker` route: sha256 of each parameter's bytes), so the engine's weights never travel back. The engine
fuses some checkpoint tensors into one parameter (its model class's `packed_modules_mapping`, e.g.
`qkv_proj: [q_proj, k_proj, v_proj]`, concatenated along dim 0); the trainer-side digest of such a parameter hashes
the parts in that order, streaming, with no concatenated copy. Where the engine cannot show a weight (vLLM-CPU
repacks linear layers to size 0; fused experts and tensor-parallel shards have no single sent counterpart), the
weight is reported as unverifiable, by name, never passed silently.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming

__all__ = ["EMPTY_DIGEST", "EngineDigests", "VerifyResult", "tensor_bytes"]

EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as vLLM hashes them (`compute_tensor_digests`: host, contiguous, flat, as uint8)."""
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data


@dataclass
class VerifyResult:
    """The comparison of one sync's engine digests with what was sent.

    Attributes:
        checked: engine weights whose digest was compared.
        mismatched: engine weights whose digest differs from the sent bytes.
        unverifiable: engine weight (or sent tensor) -> why it could not be compared.
    """

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    unverifiable: dict[str, str] = field(default_factory=dict)

    def describe(self, limit: int = 10) -> str:
        names = ", ".join(self.mismatched[:limit]) + (" ..." if len(self.mismatched) > limit else "")
        return (
            f"{len(self.mismatched)} of {self.checked} engine weight(s) differ from what was sent: {names}. Something "
            "other than this sync wrote into the engine, or the engine's loader transformed the weights."
        )

    def describe_unverifiable(self, limit: int = 5) -> str:
        reasons: dict[str, list[str]] = {}
        for name, reason in self.unverifiable.items():
            reasons.setdefault(reason, []).append(name)
        parts = [
            f"{len(names)} ({reason}; e.g. {', '.join(sorted(names)[:limit])})" for reason, names in sorted(reasons.items())
        ]
        return f"verify: {self.checked} engine weight(s) checked; unverifiable: {'; '.join(parts)}"


@dataclass
class _Fused:
    """The sent parts of one engine parameter, hashed in the engine's order as they arrive."""

    parts: int
    hasher: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    next_part: int = 0
    early: dict[int, bytes] = field(default_factory=dict)
    numel: int = 0

    def add(self, index: int, tensor: torch.Tensor) -> None:
        self.numel += tensor.numel()
        if index != self.next_part:  # arrived before a part that precedes it: keep its bytes until then
            self.early[index] = bytes(tensor_bytes(tensor))
            return
        self.hasher.update(tensor_bytes(tensor))
        self.next_part += 1
        while self.next_part in self.early:
            self.hasher.update(self.early.pop(self.next_part))
            self.next_part += 1

    @property
    def complete(self) -> bool:
        return self.next_part == self.parts


class EngineDigests:
    """Trainer-side digests of what one sync sends, per engine parameter.

    Args:
        naming: where vLLM loads each checkpoint tensor (the model's renaming and `packed_modules_mapping`).
    """

    def __init__(self, naming: EngineNaming) -> None:
        self._naming = naming
        self._entries: dict[str, _Fused] = {}
        self.seconds = 0.0

    @classmethod
    def of(cls, layout: EngineLayout) -> EngineDigests:
        """An empty digest set in an engine's layout (`EngineWriter.engine_layout`).

        Raises:
            Exception: the engine's own error where it cannot show its digests (nothing was sent yet).
        """
        if layout.no_digests is not None:
            raise layout.no_digests
        return cls(layout.naming)

    def reset(self) -> None:
        self._entries = {}
        self.seconds = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        engine_name, index, parts = self._naming.parameter(name)
        entry = self._entries.setdefault(engine_name, _Fused(parts))
        entry.add(index, tensor)
        self.seconds += time.perf_counter() - started

    def compare(self, replicas: Sequence[Mapping[str, str]], *, sharded: bool = False) -> VerifyResult:
        """Compare with the engine's digests by engine parameter name (worker prefixes removed).

        Args:
            replicas: per engine replica (data parallel), engine parameter -> sha256 hex digest as vLLM computes it.
            sharded: the engine shards weights over workers (tensor/pipeline parallel): nothing can be compared.
        """
        result = VerifyResult()
        for index, engine in enumerate(replicas):
            tag = f" (replica {index})" if len(replicas) > 1 else ""
            for name, digest in sorted(engine.items()):
                entry = self._entries.get(name)
                if sharded:
                    result.unverifiable[name + tag] = "the engine shards it over workers (tensor or pipeline parallel)"
                elif entry is None:
                    result.unverifiable[name + tag] = "no single sent tensor corresponds to it (e.g. fused experts)"
                elif not entry.complete:
                    result.unverifiable[name + tag] = "only some of its fused parts were sent"
                elif digest == EMPTY_DIGEST and entry.numel > 0:
                    result.unverifiable[name + tag] = "the engine hides it (repacked to size 0, as vLLM-CPU does)"
                else:
                    result.checked += 1
                    if entry.hasher.copy().hexdigest() != digest:
                        result.mismatched.append(name + tag)
            for name in sorted(set(self._entries) - set(engine)):
                result.unverifiable[name + tag] = "sent, but the engine reports no parameter of this name"
        return result
