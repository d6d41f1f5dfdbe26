"""Colocated writer: the engine lives in this process; weights go in with one in-place reload per sync.

Why one call with a stream: vLLM 0.32's `reload_weights` consumes an iterator and processes each layer as soon as its
weights are complete, so a single call takes the whole sync unit by unit at one layer of extra engine memory. One
call per tensor was measured 14.7x slower than one call for all (146 tensors, vLLM-CPU), and the per-tensor
`load_weights` TRL uses fails outright on repacked or quantized layers (`'Parameter' object has no attribute
'weight_loader'` on vLLM-CPU).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
from fsdp_sync.compat.engine_api import (
    EngineHandle,
    EngineLayout,
    engine_handle,
    engine_naming,
    released_for_reload,
    reset_prefix_cache,
    worker_digests,
    worker_place,
    worker_tag,
    wake_up_weights,
)
from fsdp_sync.compat.lora_api import (
    Adapter,
    EngineLoRA,
    LoRALimits,
    adapter_request,
    engine_lora_limits,
    held_adapter,
    holds_adapter,
    load_adapter,
    remove_adapter,
    served_lora_tensors,
    worker_engine_lora,
)
from fsdp_sync.compat.load_probe import Landing, probe_loads, reload_gaps
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch, patch_loader, patch_refusals
from fsdp_sync.compat.patch_write import EnginePatcher
from fsdp_sync.compat.reload_api import eager_reload_tensors, finalize_failed_reload, load_dtypes
from fsdp_sync.compat.vllm_patches import quiet_partial_reload, refresh_tied_cpu_gemms

from ..errors import EngineState, StreamInterrupted, SyncError
from ..digest import tensor_digest
from ..versions import ColocateVersions

__all__ = ["ColocateWriter", "EnginePushError"]

logger = logging.getLogger(__name__)


class EnginePushError(SyncError):
    """A push into the in-process engine stopped part-way; `engine` says what the engine holds afterwards."""


class ColocateWriter:
    """Write into an in-process `vllm.LLM`.

    Args:
        llm: the engine.
        checkpoint_dir: where to read the manifest from; defaults to the directory the engine was started from.
        wake_up_first: call `wake_up(tags=["weights"])` before each push (the engine runs with sleep mode).
    """

    pushes = True
    engine_per_rank = True

    def __init__(self, llm: Any, *, checkpoint_dir: str | None = None, wake_up_first: bool = False) -> None:
        self.handle: EngineHandle = engine_handle(llm)
        self.kind = f"colocate:{self.handle.push_kind}"
        # The layer-wise reload keeps each tensor until its layer is complete; load_weights copies at once.
        self.retains_tensors = self.handle.push_kind == "reload_weights"
        self.engine_dtype: torch.dtype | None = self.handle.dtype
        self.checkpoint_dir = checkpoint_dir or self.handle.model_path
        self.wake_up_first = wake_up_first
        self._patcher = EnginePatcher(self.handle.model)
        self._checkpoint: EngineManifest | None = None
        self._landings: dict[str, Landing] | None = None
        self._versions = ColocateVersions(llm)
        # The adapter version requests name (published), the one loaded beside it and not yet published (staged),
        # and every name this writer loaded (a name loaded again first drops the prefix cache: see `load_adapter`).
        self._adapter: Adapter | None = None
        self._staged: Adapter | None = None
        self._loaded_names: set[str] = set()

    # --- AdapterWriter: the adapter sync's capability (`fsdp_sync.sync.adapter`) ---

    def lora_limits(self) -> LoRALimits | None:
        return engine_lora_limits(self.handle.worker, self.handle.llm.llm_engine.vllm_config)

    def adapter_transport_refusal(self) -> str | None:
        return None  # the adapter is built in this process's LoRA manager

    def base_checkpoint(self) -> str:
        return self.checkpoint_dir

    def load_adapter(self, adapter: Adapter) -> None:
        """Stage `adapter` beside the published version (the mixin's engine keeps two: `engine_with_lora`).

        NOTE: vLLM keys its prefix cache by the adapter's name and path, not its id. A name this writer loaded
        before (the retry of a version whose sync failed) first drops the cache, so that nothing computed with
        the earlier contents is ever served under it."""
        if adapter.name in self._loaded_names:
            reset_prefix_cache(self.handle.llm)
        self._loaded_names.add(adapter.name)
        self._staged = adapter
        load_adapter(self.handle.worker, adapter)

    def publish_adapter(self, adapter: Adapter) -> None:
        """Requests name `adapter` from now on; the previous version is unloaded."""
        previous, self._adapter, self._staged = self._adapter, adapter, None
        if previous is not None and previous.adapter_id != adapter.adapter_id:
            remove_adapter(self.handle.worker, previous.adapter_id)

    def abandon_adapter(self) -> None:
        """Unload the staged version; the published one is loaded again where the staged one evicted it (an engine
        keeping one adapter)."""
        staged, self._staged = self._staged, None
        published = self._adapter
        if staged is not None and (published is None or staged.adapter_id != published.adapter_id):
            remove_adapter(self.handle.worker, staged.adapter_id)
        if published is not None and not holds_adapter(self.handle.worker, published.adapter_id):
            load_adapter(self.handle.worker, published)
            logger.info("weight sync: adapter %s loaded again (the failed sync's version evicted it)", published.name)

    def adapter_request(self) -> object | None:
        return adapter_request(self._adapter.adapter_id, self._adapter.name) if self._adapter is not None else None

    def adapter_digests(self) -> tuple[dict[str, dict[str, str]], EngineLoRA]:
        """Read back from this process's LoRA manager: the staged adapter, as generation would use it."""
        assert self._staged is not None, "no adapter was staged"
        lora, packed = held_adapter(self.handle.worker, self._staged.adapter_id)
        digests = {key: tensor_digest(t) for key, t in served_lora_tensors(lora, packed).items()}
        return {"": digests}, worker_engine_lora(self.handle.worker)

    def _read(self) -> tuple[EngineManifest, dict[str, Landing]]:
        """The engine's checkpoint and where its model's loader puts each tensor (read and probed once: parameter
        names and offsets do not change while the engine lives)."""
        if self._checkpoint is None or self._landings is None:
            checkpoint = read_checkpoint_manifest(self.checkpoint_dir, engine_dtype=self.engine_dtype)
            sent = {name: (spec.shape, self._sent_dtype(checkpoint, name)) for name, spec in checkpoint.tensors.items()}
            self._landings = probe_loads(self.handle.model, sent)
            self._checkpoint = checkpoint
        return self._checkpoint, self._landings

    def manifest(self) -> EngineManifest:
        """The engine's checkpoint, with what it cannot update in place: tensors its model's loader writes around the
        layer-wise reload, and those whose engine parameter it released after loading."""
        checkpoint, landings = self._read()
        refused = reload_gaps(landings) if self.handle.layerwise else {}
        released = released_for_reload(self.handle.model)
        if released:
            naming = engine_naming(self.handle.model)
            for name in checkpoint.tensors:
                reason = released.get(naming.parameter(name)[0])
                if reason is not None:
                    refused[name] = reason
        return dataclasses.replace(checkpoint, refused=refused, wider=self._wider(landings))

    def _wider(self, landings: dict[str, Landing]) -> dict[str, torch.dtype]:
        """Checkpoint names whose landing parameters the loader writes in a float dtype wider than the engine's."""
        if self.engine_dtype is None:
            return {}
        dtypes = load_dtypes(self.handle.model)
        wider: dict[str, torch.dtype] = {}
        for name, landing in landings.items():
            for param in {*landing.loaders, *(c.param for c in landing.copies)}:
                dtype = dtypes.get(param)
                if dtype is not None and dtype.is_floating_point and dtype.itemsize > self.engine_dtype.itemsize:
                    wider[name] = dtype
        return wider

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Nothing to announce: the in-place reload takes tensors in any order."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.wake_up_first:
            wake_up_weights(self.handle.llm)
        started = False
        eager: dict[str, torch.Tensor] | None = None

        def tracked() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal started, eager
            for item in weights:
                if not started and self.handle.layerwise:
                    # The reload has started (its layers are on the meta device) and nothing has arrived yet.
                    eager = eager_reload_tensors(self.handle.model)
                started = True
                yield item

        try:
            with quiet_partial_reload():
                self.handle.push(tracked())
        except Exception as e:
            state = self._state_after_failure(started, eager)
            refresh_tied_cpu_gemms(self.handle.model)
            # The engine's weights changed where layers completed: KV blocks cached from the old ones are stale.
            reset_prefix_cache(self.handle.llm)
            what = (
                "stopped because the weight stream failed upstream"
                if isinstance(e, StreamInterrupted)
                else f"failed in the engine ({type(e).__name__}: {e})"
            )
            raise EnginePushError(
                f"The push into the vLLM engine {what}. The engine {state.describe()}; the next sync sends every "
                "weight.",
                engine=state,
            ) from e
        refresh_tied_cpu_gemms(self.handle.model)

    def _state_after_failure(self, started: bool, eager: dict[str, torch.Tensor] | None) -> EngineState:
        """End the interrupted reload (the engine must stay usable) and say what it holds."""
        if not self.handle.layerwise:  # an engine that loads each tensor as it comes (`load_weights`)
            if not started:
                return EngineState("unchanged")
            return EngineState("mixed", note="loaded tensor by tensor: the tensors reached hold new values")
        handle = self.handle
        previous, new = finalize_failed_reload(handle.model, handle.model_config, handle.device, eager)
        if not new:
            return EngineState("unchanged")
        return EngineState(
            "mixed", previous, note="layers that had received part of their weights were given their previous ones back"
        )

    def sparse_refusal(self) -> str | None:
        if patch_loader() is None:
            return "this vLLM has no load_checkpoint_weight_patches (vLLM >= 0.32)"
        if self.wake_up_first:
            return "the engine sleeps between syncs (TRL's sleep mode, level 2), which discards its weights"
        return None

    def patch_refusals(self) -> dict[str, str]:
        return patch_refusals(self.handle.model)

    def write_patches(self, patches: Sequence[EnginePatch]) -> None:
        if self.wake_up_first:
            wake_up_weights(self.handle.llm)
        try:
            self._patcher.apply(patches)
        except Exception as e:
            reset_prefix_cache(self.handle.llm)
            raise EnginePushError(
                f"Writing the sparse patches into the vLLM engine failed ({type(e).__name__}: {e}). vLLM's patch "
                "loader does not roll back: each element patched holds its new value, the others their previous "
                "one; the next sync sends every weight.",
                engine=EngineState("mixed", note="vLLM's patch loader writes element by element and does not roll back"),
            ) from e

    def finish(self) -> None:
        reset_prefix_cache(self.handle.llm)

    def replaced(self) -> str | None:
        return self._versions.replaced()

    def stamp(self, version: str) -> str | None:
        return self._versions.stamp(version)

    def engine_layout(self) -> EngineLayout:
        model = self.handle.model
        modules = frozenset(name.rpartition(".")[0] for name, _ in model.named_parameters())
        checkpoint, landings = self._read()
        known = {name: landing for name, landing in landings.items() if landing.error is None}
        transformed = frozenset(
            name for name, landing in known.items()
            if landing.copies and not landing.predictable(self._sent_dtype(checkpoint, name))
        )  # fmt: skip
        lands_in = {
            name: tuple(sorted({*landing.loaders, *(c.param for c in landing.copies)})) for name, landing in known.items()
        }
        rules = None
        if self.handle.tensor_parallel:  # this rank's engine holds its tensor-parallel rank's cut of each weight
            from fsdp_sync.compat.tp_shards import shard_rules

            rules = {worker_place(worker_tag(self.handle.worker)): shard_rules(model)}
        return EngineLayout(engine_naming(model), modules, transformed=transformed, lands_in=lands_in, shard_rules=rules)


    def _sent_dtype(self, checkpoint: EngineManifest, name: str) -> torch.dtype:
        stored = checkpoint.tensors[name].dtype
        return self.engine_dtype if self.engine_dtype is not None and stored.is_floating_point else stored

    def engine_digests(self) -> tuple[dict[str, dict[str, str]], bool]:
        compute = getattr(self.handle.worker, "compute_weight_checksums", None)
        if compute is not None:  # vLLM's own (the `/weight_checker` route's source; vLLM 0.32)
            return worker_digests(compute())
        digests = {name: tensor_digest(p) for name, p in self.handle.model.named_parameters()}
        return {"": digests}, self.handle.tensor_parallel
