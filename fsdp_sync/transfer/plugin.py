"""The `vllm.general_plugins` entry point: registers this package's weight-transfer backends in vLLM's registries.

vLLM calls every function of that entry-point group at the start of each of its processes (API server, engine core,
workers), so `vllm serve ... --weight-transfer-config '{"backend": "gloo"}'` finds the backend once this package is
installed. Registration is lazy (a module path), so nothing is imported until a server or trainer uses the backend.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "register"]

# backend name -> (module, worker-side engine class, trainer-side engine class)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "gloo": ("fsdp_sync.transfer.gloo", "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
}


def register() -> None:
    """Register every backend of `BACKENDS` on both sides; idempotent (vLLM may call plugins more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name, (module, engine_cls, trainer_cls) in BACKENDS.items():
        # NOTE: the registries raise on a second registration of a name; `_registry` is the only way to ask.
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, engine_cls)
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, module, trainer_cls)
