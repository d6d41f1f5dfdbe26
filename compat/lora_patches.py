"""Patches of vLLM's LoRA loading so that a vLLM server serves adapters pushed in memory (vLLM 0.32's `vllm/lora/`,
`vllm/entrypoints/openai/models/serving.py`; needed by every vLLM with the path-only adapter API, 0.28-0.34 read).

Why: a server loads an adapter when a request names it, from the path its `LoRARequest` carries (the worker's
`WorkerLoRAManager._load_adapter`), under an id the API server picks itself (`OpenAIServingModels.resolve_lora`
overwrites the resolver's). An adapter that arrived over the weight transfer has no path, and its id cannot be
chosen by the sender. So:
- the worker keeps each pushed adapter, built and checked, by name (`stash_adapter`);
- `serve_in_memory_adapters` makes `_load_adapter` take a request whose path is `IN_MEMORY_PATH/<name>` from there,
  under whatever id the request has, and unload the adapters of earlier pushes as it does (one version at a time);
- `InMemoryLoRAResolver` answers the API server's question "what is adapter <name>" for pushed names, so a request
  for `model=<name>` is served (the server needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which lets it ask resolvers).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from .lora_api import IN_MEMORY_PATH, Adapter, build_lora_model

__all__ = ["ADAPTER_NAME", "InMemoryLoRAResolver", "register_resolver", "serve_in_memory_adapters", "stash_adapter"]

logger = logging.getLogger(__name__)

# The names adapter syncs give their versions (`fsdp_sync.sync.adapter.AdapterSync`): `<prefix>-v<N>`.
ADAPTER_NAME = re.compile(r"^[\w.-]+-v\d+$")
_PATCHED = "_fvs_in_memory"

# name -> the LoRAModel pushed under it, not yet loaded (this worker process).
_STASHED: dict[str, Any] = {}
# name -> the id it was loaded under (this worker process), for unloading it when a newer push is loaded.
_LOADED: dict[str, int] = {}


def stash_adapter(model: Any, adapter: Adapter) -> None:
    """Build and check `adapter` for the engine `model` (a model vLLM's LoRA manager wraps: `model.lora_manager`),
    and keep it until a request asks for it; earlier stashed versions are dropped.

    Raises:
        RuntimeError: the engine was started without LoRA.
        ValueError: the engine cannot serve the adapter (nothing is kept).
    """
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM server was started without LoRA (--enable-lora): it cannot take adapters")
    text = model.config.get_text_config() if hasattr(model, "config") else None
    lora = build_lora_model(
        manager,
        adapter,
        lora_config=manager.lora_config,
        vocab_size=manager.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
    )
    _STASHED.clear()
    _STASHED[adapter.name] = lora


def serve_in_memory_adapters() -> None:
    """Make this process's `WorkerLoRAManager._load_adapter` serve stashed adapters (idempotent)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, _PATCHED, False):
        return

    def load(self: Any, lora_request: Any) -> Any:
        if not str(lora_request.lora_path).startswith(IN_MEMORY_PATH):
            return original(self, lora_request)
        name = lora_request.lora_name
        lora = _STASHED.pop(name, None)
        if lora is None:
            from vllm.exceptions import LoRAAdapterNotFoundError

            raise LoRAAdapterNotFoundError(name, lora_request.lora_path)
        for old, old_id in list(_LOADED.items()):
            self._adapter_manager.remove_adapter(old_id)
            del _LOADED[old]
        lora.id = lora_request.lora_int_id
        _LOADED[name] = lora.id
        return lora

    setattr(load, _PATCHED, True)
    WorkerLoRAManager._load_adapter = load  # type: ignore[method-assign]


class InMemoryLoRAResolver:
    """Resolves the names adapter syncs push to a request for the stashed adapter (API server process)."""

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
        from vllm.lora.request import LoRARequest

        if not ADAPTER_NAME.match(lora_name):
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=f"{IN_MEMORY_PATH}/{lora_name}")


def register_resolver() -> None:
    """Register `InMemoryLoRAResolver` with vLLM's resolver registry (where it has one)."""
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

    resolver_cls = type("FSDPVLLMSyncLoRAResolver", (InMemoryLoRAResolver, LoRAResolver), {})
    if "fsdp-vllm-sync" not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver("fsdp-vllm-sync", resolver_cls())
