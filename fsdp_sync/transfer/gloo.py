"""`"gloo"`: a CPU weight-transfer backend for vLLM's weight-update API (gloo collectives over TCP).

Why: vLLM 0.32's built-in backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) are CUDA-only, and its NCCL engine
on a CPU build reports success while moving nothing (vLLM #57022). This backend runs wherever torch's gloo does: a
CPU-only server, a test deployment, or a GPU server whose trainer has no NCCL path to it.

The backend's name in vLLM's registries (`plugin.BACKENDS`) points here; the code lives in one module per concern:
- `gloo_wire`: the wire format both ends share (the handshake's rendezvous, chunks and their status trailer, the
  receive loop, the abort marker, the update's announcement `GlooUpdateInfo`);
- `gloo_worker`: the worker side, inside each vLLM worker (dense, sparse, staged and adapter rounds);
- `gloo_trainer`: the trainer side (the handshake, one round helper for every kind of update, staging);
- `staging`: staging as a declared capability of a trainer-side engine (`StagedTransfer`), which writers use.
The trainer's questions to the workers (`questions`) use the group too: answers that must come from every
data-parallel replica travel back over it (`GlooTrainerWeightTransferEngine.gather_answers`).
"""

from __future__ import annotations

from .gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
from .gloo_wire import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    Chunk,
    GlooUpdateInfo,
    GlooWorkerInitInfo,
    UpdateAborted,
    plan_chunks,
)
from .gloo_worker import GlooWeightTransferEngine

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_TIMEOUT_S",
    "Chunk",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
    "GlooWorkerInitInfo",
    "UpdateAborted",
    "plan_chunks",
]
