"""Patches of vLLM's LoRA loading so that a vLLM server serves adapters pushed in memory, the last `K` versions of
them, and refuses every other version cleanly (vLLM 0.32's `vllm/lora/`, `vllm/entrypoints/openai/models/serving.py`,
`vllm/v1/engine/async_llm.py`; needed by every vLLM with the path-only adapter API, 0.28-0.34; the API server's
patch points read and run on 0.32 only).

Why: a server loads an adapter when a request names it, from the path its `LoRARequest` carries (the worker's
`WorkerLoRAManager._load_adapter`), under an id the API server picks itself. An adapter that arrived over the weight
transfer has no path, and its id cannot be chosen by the sender. And the API server remembers every name it ever
resolved (`OpenAIServingModels.lora_requests`): a request naming a version the worker no longer has goes straight
to the worker's `execute_model`, whose `LoRAAdapterNotFoundError` kills the engine (HTTP 500, then `/health` 503).
So:
- worker: each pushed adapter is built and checked (`stash_adapter`) and kept by name, the last `K` versions
  (`kept_versions`: `ADAPTER_VERSIONS_ENV`, at most the server's `max_cpu_loras`); `serve_in_memory_adapters` makes
  `_load_adapter` serve a request whose path is `IN_MEMORY_PATH/<name>` from those, under whatever id it carries;
- API server (`guard_served_adapters`): after each adapter push that succeeded, the names the API server serves
  become exactly the last `K` pushed (`/v1/models` lists them; a request naming any other version is answered 404
  before it reaches the engine), and the new version gets a fresh id (a re-pushed name never reuses the old one's).
  No resolver is asked (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is not needed): the pushed names are registered directly.

Known limit: the API server learns the served names from the pushes it forwards, so this holds for a server with
one API server process (vLLM's default; `--api-server-count` above 1 is not covered).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .lora_api import IN_MEMORY_PATH, Adapter, build_lora_model

__all__ = [
    "ADAPTER_VERSIONS_ENV",
    "KEPT_VERSIONS_METHOD",
    "guard_served_adapters",
    "kept_adapter",
    "kept_versions",
    "loaded_adapter_names",
    "serve_in_memory_adapters",
    "served_adapters",
    "stash_adapter",
    "version_refusal",
]

logger = logging.getLogger(__name__)

# Set on the server: how many adapter versions stay servable (default 1). Requests of a version still in flight
# when newer ones are pushed finish on the weights that started them as long as the version is among the last K.
ADAPTER_VERSIONS_ENV = "FSDP_VLLM_SYNC_ADAPTER_VERSIONS"
# The worker method (on vLLM's `WorkerBase`, added by this package's gloo backend) answering `kept_versions()` through
# `/collective_rpc`.
KEPT_VERSIONS_METHOD = "fsdp_vllm_sync_kept_versions"
_PATCHED = "_fvs_in_memory"

# Worker process: name -> the LoRAModel pushed under it, the last `kept_versions()` pushes, oldest first.
_SERVED: OrderedDict[str, Any] = OrderedDict()
# Worker process: id -> the name it was loaded under (what the worker's LoRA manager holds, for checks).
_LOADED: dict[int, str] = {}
# API server process: the names servable, oldest first, as the pushes that succeeded left them.
_API_SERVED: list[str] = []
# API server process: its `OpenAIServingModels` (the holders of `lora_requests`).
_SERVING_MODELS: weakref.WeakSet[Any] = weakref.WeakSet()


def kept_versions() -> int:
    """`K`: how many adapter versions a server keeps servable (`ADAPTER_VERSIONS_ENV`, default 1).

    Raises:
        ValueError: the variable is not a positive integer.
    """
    raw = os.environ.get(ADAPTER_VERSIONS_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ADAPTER_VERSIONS_ENV}={raw!r}: give the number of adapter versions to keep (1 or more)")
    return int(raw)


def version_refusal(keep: int, lora_config: Any) -> str | None:
    """Why `keep` versions cannot stay loaded in an engine with this `LoRAConfig` (None: they can).

    NOTE: bounded by `max_cpu_loras` (the LoRA manager's cache, which is at least `max_loras`): beyond it the
    manager would evict a kept version that requests may still name. `max_loras` (the adapters one batch runs)
    only makes requests of different versions take turns."""
    bound = lora_config.max_cpu_loras or lora_config.max_loras
    if keep <= bound:
        return None
    return (
        f"{ADAPTER_VERSIONS_ENV}={keep} adapter versions cannot stay loaded: the server holds at most "
        f"max_cpu_loras={bound} adapters (max_loras={lora_config.max_loras}); start it with --max-cpu-loras {keep} "
        f"(and --max-loras up to that) or keep fewer versions"
    )


def stash_adapter(model: Any, adapter: Adapter) -> None:
    """Build and check `adapter` for the engine `model` (a model vLLM's LoRA manager wraps: `model.lora_manager`),
    and keep it servable by name; the oldest kept version beyond `kept_versions()` stops being servable.

    Raises:
        RuntimeError: the engine was started without LoRA.
        ValueError: the engine cannot serve the adapter, or cannot keep `kept_versions()` versions (nothing is kept).
    """
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM server was started without LoRA (--enable-lora): it cannot take adapters")
    keep = kept_versions()
    refusal = version_refusal(keep, manager.lora_config)
    if refusal is not None:
        raise ValueError(refusal)
    text = model.config.get_text_config() if hasattr(model, "config") else None
    lora = build_lora_model(
        manager,
        adapter,
        lora_config=manager.lora_config,
        vocab_size=manager.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
    )
    _SERVED.pop(adapter.name, None)
    _SERVED[adapter.name] = lora
    # NOTE: a version pushed out is not removed from the LoRA manager: a request that started on it may still be
    # running and re-activates it every step. The API server refuses new requests for it (`guard_served_adapters`),
    # and the manager's own LRU cache (max_cpu_loras) evicts it once newer versions need the room.
    while len(_SERVED) > keep:
        retired, _ = _SERVED.popitem(last=False)
        logger.info("fsdp-vllm-sync: adapter %s is no longer served (%d versions kept)", retired, keep)


def kept_adapter(name: str) -> Any | None:
    """The `LoRAModel` this worker keeps to serve under `name` (the object its LoRA manager registers when a request
    names it); None where it keeps no such version."""
    return _SERVED.get(name)


def served_adapters() -> list[str]:
    """The adapter names this worker serves, oldest first."""
    return list(_SERVED)


def loaded_adapter_names() -> dict[int, str]:
    """id -> name of the in-memory adapters this worker's LoRA manager was given (ids it may since have evicted)."""
    return dict(_LOADED)


def serve_in_memory_adapters() -> None:
    """Make this process's `WorkerLoRAManager._load_adapter` serve kept adapters (idempotent)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, _PATCHED, False):
        return

    def load(self: Any, lora_request: Any) -> Any:
        if not str(lora_request.lora_path).startswith(IN_MEMORY_PATH):
            return original(self, lora_request)
        name = lora_request.lora_name
        lora = _SERVED.get(name)
        if lora is None:
            from vllm.exceptions import LoRAAdapterNotFoundError

            # NOTE: the API server answers requests for versions not served with a 404 before they reach the
            # engine; this is reached by `add_lora` (a clean 400) or by a request that outlived its version.
            raise LoRAAdapterNotFoundError(name, lora_request.lora_path)
        lora.id = lora_request.lora_int_id
        _LOADED[lora.id] = name
        return lora

    setattr(load, _PATCHED, True)
    WorkerLoRAManager._load_adapter = load  # type: ignore[method-assign]


def _pushed_adapter_names(update_info: Any) -> list[str]:
    """The adapter names an `/update_weights` payload pushes (the gloo backend's `adapter` field)."""
    infos: Iterable[Any] = update_info if isinstance(update_info, list) else [update_info]
    return [str(i["adapter"]["name"]) for i in infos if isinstance(i, dict) and isinstance(i.get("adapter"), dict)]


def _serve_pushed(name: str, keep: int) -> None:
    """API server: `name` was pushed; make every `OpenAIServingModels` serve exactly the last `keep` pushed names."""
    from vllm.lora.request import LoRARequest

    if name in _API_SERVED:
        _API_SERVED.remove(name)
    _API_SERVED.append(name)
    del _API_SERVED[:-keep]
    for models in list(_SERVING_MODELS):
        requests = models.lora_requests
        for stale in [n for n, r in requests.items() if _in_memory(r) and n not in _API_SERVED]:
            del requests[stale]
        # NOTE: a fresh id for every push, a re-pushed name included: the worker's LoRA manager may still hold the
        # previous adapter under the old id and would serve it without asking for the new one.
        requests[name] = LoRARequest(
            lora_name=name, lora_int_id=models.lora_id_counter.inc(1), lora_path=f"{IN_MEMORY_PATH}/{name}"
        )
    logger.info("fsdp-vllm-sync: adapters served: %s", ", ".join(_API_SERVED))


def _in_memory(request: Any) -> bool:
    return str(getattr(request, "lora_path", "")).startswith(IN_MEMORY_PATH)


def guard_served_adapters() -> None:
    """API server: keep `OpenAIServingModels.lora_requests` equal to the adapter versions served (idempotent).

    Patches `OpenAIServingModels.__init__` (to find the instances) and `AsyncLLM.update_weights` (after an adapter
    push succeeded on every worker, its name is served and versions beyond `kept_versions()` are dropped)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # NOTE: its module before vLLM moved it under models/ (not run here: only 0.32 is installed)
        from vllm.entrypoints.openai.serving_models import OpenAIServingModels  # type: ignore[no-redef]

    if getattr(AsyncLLM.update_weights, _PATCHED, False):
        return
    original_init = OpenAIServingModels.__init__
    original_update = AsyncLLM.update_weights

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _SERVING_MODELS.add(self)

    async def update_weights(self: Any, request: Any) -> None:
        await original_update(self, request)
        names = _pushed_adapter_names(getattr(request, "update_info", None))
        if names:
            keep = kept_versions()
            for name in names:
                _serve_pushed(name, keep)

    setattr(update_weights, _PATCHED, True)
    OpenAIServingModels.__init__ = init  # type: ignore[method-assign]
    AsyncLLM.update_weights = update_weights  # type: ignore[method-assign]
