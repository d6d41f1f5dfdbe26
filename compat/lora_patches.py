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
- worker: each pushed adapter is built and checked (`stash_adapter`) and staged by name; the trainer publishes it
  once its sync was verified (`publish_adapter`, a push without tensors), and only then is it served: the last `K`
  published versions are kept (`kept_versions`: `ADAPTER_VERSIONS_ENV`, at most the server's `max_cpu_loras`);
  `serve_in_memory_adapters` makes `_load_adapter` serve a request whose path is `IN_MEMORY_PATH/<name>` from those,
  under whatever id it carries. A staged version that is never published is replaced by the next push;
- API server (`guard_served_adapters`): after each publish that succeeded, the names the API server serves become
  exactly the last `K` published (`/v1/models` lists them; a request naming any other version, a staged one
  included, is answered 404 before it reaches the engine), and the new version gets a fresh id. A name published
  before in this server's life (a trainer that started again from v1) first drops the prefix cache: vLLM keys it by
  the adapter's name and path, and would serve blocks computed with the earlier contents. No resolver is asked
  (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is not needed): the published names are registered directly.

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
    "guard_served_adapters",
    "kept_adapter",
    "kept_versions",
    "loaded_adapter_names",
    "publish_adapter",
    "serve_in_memory_adapters",
    "served_adapters",
    "stash_adapter",
    "version_refusal",
]

logger = logging.getLogger(__name__)

# Set on the server: how many adapter versions stay servable (default 1). Requests of a version still in flight
# when newer ones are pushed finish on the weights that started them as long as the version is among the last K.
ADAPTER_VERSIONS_ENV = "FSDP_VLLM_SYNC_ADAPTER_VERSIONS"
_PATCHED = "_fvs_in_memory"

# Worker process: name -> the LoRAModel published under it, the last `kept_versions()` publishes, oldest first.
_SERVED: OrderedDict[str, Any] = OrderedDict()
# Worker process: the version pushed and not yet published (name -> LoRAModel; at most one).
_STAGED: dict[str, Any] = {}
# Worker process: id -> the name it was loaded under (what the worker's LoRA manager holds, for checks).
_LOADED: dict[int, str] = {}
# API server process: the names servable, oldest first, as the publishes that succeeded left them; and every name
# ever published (a name published again first drops the prefix cache).
_API_SERVED: list[str] = []
_API_EVER: set[str] = set()
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
    and stage it by name (replacing a version staged before and never published); `publish_adapter` makes it
    servable.

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
    _STAGED.clear()
    _STAGED[adapter.name] = lora


def publish_adapter(name: str, *, fresh: bool = False) -> None:
    """The staged version `name` becomes servable; the oldest published version beyond `kept_versions()` stops
    being servable. `fresh`: a trainer's first publish: every version served before (another trainer's) stops
    being servable.

    Raises:
        KeyError: no version `name` is staged (nothing changes).
    """
    lora = _STAGED.pop(name, None)
    if lora is None:
        raise KeyError(f"no adapter {name} was pushed to publish (staged: {sorted(_STAGED)})")
    keep = kept_versions()
    if fresh:
        _SERVED.clear()
    _SERVED.pop(name, None)
    _SERVED[name] = lora
    # NOTE: a version published out is not removed from the LoRA manager: a request that started on it may still be
    # running and re-activates it every step. The API server refuses new requests for it (`guard_served_adapters`),
    # and the manager's own LRU cache (max_cpu_loras) evicts it once newer versions need the room.
    while len(_SERVED) > keep:
        retired, _ = _SERVED.popitem(last=False)
        logger.info("fsdp-vllm-sync: adapter %s is no longer served (%d versions kept)", retired, keep)


def kept_adapter(name: str) -> Any | None:
    """The `LoRAModel` this worker keeps under `name`, staged (for the trainer's verify, before it is published) or
    published (the object its LoRA manager registers when a request names it); None where it keeps no such
    version."""
    return _STAGED.get(name, _SERVED.get(name))


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


def _published_adapter_names(update_info: Any) -> list[tuple[str, bool]]:
    """The adapter names an `/update_weights` payload publishes, each with its `fresh` flag (the gloo backend's
    `publish` and `fresh` fields)."""
    infos: Iterable[Any] = update_info if isinstance(update_info, list) else [update_info]
    return [
        (str(i["publish"]), bool(i.get("fresh")))
        for i in infos
        if isinstance(i, dict) and isinstance(i.get("publish"), str)
    ]


def _serve_published(name: str, keep: int, *, fresh: bool = False) -> None:
    """API server: `name` was published; make every `OpenAIServingModels` serve exactly the last `keep` published
    names (only `name`, after a trainer's first publish: `fresh`)."""
    from vllm.lora.request import LoRARequest

    _API_EVER.add(name)
    if fresh:
        _API_SERVED.clear()
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

    Patches `OpenAIServingModels.__init__` (to find the instances) and `AsyncLLM.update_weights` (after a publish
    succeeded on every worker, its name is served and versions beyond `kept_versions()` are dropped)."""
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
        published = _published_adapter_names(getattr(request, "update_info", None))
        names = [name for name, _ in published]
        if any(name in _API_EVER for name in names):
            # NOTE: before the workers serve the new contents under a name served before: nothing the engine
            # cached under it may be served again (the prefix cache is keyed by the adapter's name and path).
            if await self.reset_prefix_cache() is False:
                # NOTE: vLLM refuses while running requests hold cached blocks; those blocks were computed under
                # the old contents and stay keyed by the name until they are evicted.
                logger.warning("fsdp-vllm-sync: adapter %s is published again, but vLLM kept its prefix cache "
                               "(requests were running)", ", ".join(names))  # fmt: skip
            else:
                logger.info("fsdp-vllm-sync: prefix cache dropped: adapter %s is published again", ", ".join(names))
        await original_update(self, request)
        if published:
            keep = kept_versions()
            for name, fresh in published:
                _serve_published(name, keep, fresh=fresh)

    setattr(update_weights, _PATCHED, True)
    OpenAIServingModels.__init__ = init  # type: ignore[method-assign]
    AsyncLLM.update_weights = update_weights  # type: ignore[method-assign]
