"""The `vllm.general_plugins` entry point: registers this package's weight-transfer backends in vLLM's registries.

vLLM calls every function of that entry-point group at the start of each of its processes (API server, engine core,
workers), so `vllm serve ... --weight-transfer-config '{"backend": "gloo"}'` finds the backend once this package is
installed. Registration is lazy (a module path), so nothing is imported until a server or trainer uses the backend.

NOTE: vLLM 0.32's `load_general_plugins()` guards loading a plugin but not calling it: an exception raised here would
stop every vLLM process where this package is installed, colocated engines included. So `register()` never raises:
it registers what the installed vLLM has (the weight-transfer registries came with vLLM 0.28) and logs what it
skipped and why.
"""

from __future__ import annotations

import logging

__all__ = ["BACKENDS", "register"]

logger = logging.getLogger(__name__)

# backend name -> (module, worker-side engine class, trainer-side engine class)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "gloo": ("fsdp_sync.transfer.gloo", "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
}


def register() -> None:
    """Register every backend of `BACKENDS` in every registry vLLM has; idempotent (vLLM may call plugins twice)."""
    try:
        from fsdp_sync.compat.weight_transfer import register_backends

        registered, skipped = register_backends(BACKENDS)
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning("fsdp-vllm-sync: weight-transfer backends not registered (%s: %s)", type(e).__name__, e)
        return
    if skipped:
        logger.warning("fsdp-vllm-sync: weight-transfer backends not registered: %s", "; ".join(skipped))
    if registered:
        logger.debug("fsdp-vllm-sync: registered weight-transfer backends: %s", ", ".join(registered))
