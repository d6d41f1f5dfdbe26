"""`FSDPVLLMSyncMixin`: replaces a TRL trainer's vLLM weight sync with this library's; wiring only.

    class MyTrainer(FSDPVLLMSyncMixin, GRPOTrainer): ...

The mixin finds the trainer's sync entry point (compat.trl_api), and on each sync: detects the backend from the
wrapped model, builds the gatherer, writer and plan once per model object, runs the pipeline, and logs the figures.
Everything else about the trainer is unchanged.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch

from fsdp_sync.compat.trl_api import (
    ASYNC_SYNC_WEIGHT,
    MOVE_MODEL_TO_VLLM,
    ServerAddress,
    TRLSyncTarget,
    defer_trl_weight_communicator,
    find_sync_target,
    log_sync_metrics,
    mark_weights_awake,
    server_address,
    server_mode_problem,
)
from fsdp_sync.compat.engine_api import engine_handle, transformers_backend
from fsdp_sync.compat.trl_adapter import ask_for_adapter, ask_server_for_adapter, engine_with_lora, peft_rank
from fsdp_sync.compat.cpu_lora_base_requests import skip_lora_for_base_requests
from fsdp_sync.compat.vllm_patches import keep_cpu_linear_weights, keep_mla_kv_b_proj_weights
from fsdp_sync.compat.weight_transfer import missing_api

from .backend import Backend, detect_backend
from .config import SyncConfig
from .distributed import Coordinator
from .errors import EngineState, SyncError, UnsupportedSetupError, agreed_error
from .faults import fault_point
from .assemble import build_sync
from .sync.contract import Sync
from .sync.stream import SyncPlan
from .report import SyncReport
from .trainers import seam_for
from .writers import ColocateWriter, EngineWriter

if TYPE_CHECKING:
    from fsdp_sync.compat.server_api import ServerInfo

    from .writers.server import ServerWriter

__all__ = ["FSDPVLLMSyncMixin"]

logger = logging.getLogger(__name__)


class FSDPVLLMSyncMixin:
    """Mix into a TRL GRPO-family trainer (first in the bases) to sync weights correctly under FSDP1/FSDP2/DDP.

    Args (keyword, besides the trainer's own):
        sync_config: options; defaults to `SyncConfig()` (the flat strategy on both FSDP versions).

    Attributes:
        sync_reports: one `SyncReport` per sync on this rank, in order.
    """

    def __init__(self, *args: Any, sync_config: SyncConfig | None = None, **kwargs: Any) -> None:
        config = sync_config or SyncConfig()
        init = super().__init__
        try:
            bound = inspect.signature(init).bind_partial(*args, **kwargs).arguments
        except TypeError:  # let the trainer's own constructor report bad arguments
            bound = {}
        trainer_args = bound.get("args")
        # The one decision on the trainer family (TRL's async trainer has a seam of its own; the others change
        # nothing): its constructor arguments, its options, its writer's, its sync entry point.
        self._fvs_seam = seam_for(type(self), FSDPVLLMSyncMixin)
        self._fvs_server_writer: ServerWriter | None = None
        kwargs = self._fvs_seam.constructor_kwargs(bound, kwargs, self._fvs_close_transfer)
        config = self._fvs_seam.sync_config(config)
        self._fvs_server_address: ServerAddress | None = server_address(
            trainer_args, always_server=self._fvs_seam.always_server, group_port=config.group_port
        )
        self._fvs_server_info: ServerInfo | None = None
        if self._fvs_server_address is not None:
            problem = server_mode_problem() or missing_api()
            if problem is not None:
                raise UnsupportedSetupError(f"Server mode with fsdp-vllm-sync: {problem}.")
            from .writers.server import check_server

            # NOTE: on every rank, before the trainer is built: TRL checks the server on the main process only, and
            # a failure there leaves the other ranks waiting in the barrier that follows. The transport is the
            # server's own (chosen at the first sync), so TRL's CUDA-only communicator set-up is deferred.
            self._fvs_server_info = check_server(self._fvs_server_address, timeout_s=config.server_timeout_s)
            with defer_trl_weight_communicator():
                init(*args, **kwargs)
        else:
            if config.sparse:
                # NOTE: before the trainer builds its colocated engine: a sparse sync writes linear weights in place,
                # which vLLM-CPU packs away at load unless told to keep them (no effect on other platforms).
                keep_cpu_linear_weights()
            # NOTE: also before the engine is built: vLLM-CPU's latent attention (DeepSeek) frees a weight every
            # reload needs right after the first load (no effect elsewhere; see compat.vllm_patches).
            keep_mla_kv_b_proj_weights()
            # NOTE: vLLM-CPU served base-model requests batched with adapter requests with the adapter (no effect
            # elsewhere; this package's vLLM plugin does the same where plugins load: compat.cpu_lora_base_requests).
            skip_lora_for_base_requests()
            with _engine_for_adapters(config, bound.get("peft_config")):
                init(*args, **kwargs)
        self.sync_config = config
        self.sync_reports: list[SyncReport] = []
        self._fvs_sync: Sync | None = None
        self._fvs_model: torch.nn.Module | None = None
        self._fvs_backend: Backend | None = None
        self._fvs_stale = False
        self._fvs_target: TRLSyncTarget | None = find_sync_target(self, FSDPVLLMSyncMixin)
        self._fvs_refuse_generic_backend()
        # The trainer's own sync, kept for DeepSpeed runs (left to it).
        self._fvs_builtin_sync = None
        if self._fvs_target is not None:
            if self._fvs_target.entry == ASYNC_SYNC_WEIGHT:
                pass  # the trainer's callbacks call `_sync_weight`, the mixin's; TRL's own needs NCCL (no fallback)
            elif self._fvs_target.entry == MOVE_MODEL_TO_VLLM:
                self._fvs_builtin_sync = super()._move_model_to_vllm  # type: ignore[misc]
            else:
                owner = self._fvs_target.owner
                self._fvs_builtin_sync = owner.sync_weights
                owner.sync_weights = self.sync_weights_to_vllm
                if callable(getattr(owner, "generate", None)):
                    self._fvs_guard_generation(owner)

    def _fvs_refuse_generic_backend(self) -> None:
        """Before training starts: refuse a colocated engine that serves the model through vLLM's generic
        Transformers backend (it changes transformers' classes in this process, and the trainer's first forward
        would die in them); the error points to server mode."""
        target = self._fvs_target
        if target is None or target.mode != "colocate" or target.llm is None:
            return
        try:
            model = engine_handle(target.llm).model
        except RuntimeError:  # an engine out of process: the writer says so at the first sync
            return
        problem = transformers_backend(model)
        if problem is not None:
            raise UnsupportedSetupError(f"Colocated training with fsdp-vllm-sync: {problem}.")

    def _fvs_close_transfer(self) -> None:
        """Close this package's transfer to the server, if one was set up (the end of training)."""
        if self._fvs_server_writer is not None:
            self._fvs_server_writer.close()

    # Older TRL and the experimental OnlineDPOTrainer call this method; the mixin comes first in the MRO.
    def _move_model_to_vllm(self, *args: Any, **kwargs: Any) -> None:
        self.sync_weights_to_vllm()

    # TRL's async trainer calls this from its callbacks (train begin, every `weight_sync_steps`).
    def _sync_weight(self, *args: Any, **kwargs: Any) -> None:
        target = self._fvs_target
        if target is None or target.entry != ASYNC_SYNC_WEIGHT:
            super()._sync_weight(*args, **kwargs)  # type: ignore[misc]
            return
        self._fvs_seam.sync(self, self.sync_weights_to_vllm, self._fvs_last_pause)

    def _fvs_last_pause(self) -> tuple[float, float] | None:
        """The last push's pause of the server (`ServerWriter.last_pause`; read after the sync, whose first call
        builds the writer)."""
        writer = self._fvs_server_writer
        return writer.last_pause if writer is not None else None

    @property
    def adapter_request(self) -> object | None:
        """The `LoRARequest` of the adapter the last adapter sync loaded (None with merged syncs, before the first
        sync, and on ranks without an engine): what generation must pass to be served the trained adapter."""
        return self._fvs_sync.adapter_request() if self._fvs_sync is not None else None

    @property
    def sync_plan(self) -> SyncPlan | None:
        """What each sync sends (trainer name -> checkpoint name, dropped names); None before the first sync, or
        when its plan failed the check (the error says why)."""
        return self._fvs_sync.sync_plan if self._fvs_sync is not None else None

    @property
    def sync_backend(self) -> Backend | None:
        """The backend detected at the last sync (None before the first)."""
        return self._fvs_backend

    def _fvs_writer(self) -> EngineWriter:
        target = self._fvs_target
        assert target is not None
        checkpoint = self.sync_config.checkpoint_dir
        match target.mode:
            case "colocate":
                return ColocateWriter(target.llm, checkpoint_dir=checkpoint, wake_up_first=target.sleep_mode)
            case "server":
                from .server_client import ServerClient
                from .writers.server import ServerWriter

                address, info = self._fvs_server_address, self._fvs_server_info
                if address is None or info is None:
                    raise RuntimeError(
                        "server mode without a server address in the trainer's args (use_vllm=True, "
                        "vllm_mode='server', vllm_server_base_url or vllm_server_host/port); not supported"
                    )
                config = self.sync_config
                main = self.accelerator.is_main_process  # type: ignore[attr-defined]
                options = self._fvs_seam.writer_options(self)
                writer = ServerWriter(
                    ServerClient(address.base_url, timeout=config.server_timeout_s) if main else None,
                    info,
                    group_port=address.group_port,
                    checkpoint_dir=checkpoint,
                    buffer_bytes=config.server_buffer_bytes,
                    timeout_s=config.server_timeout_s,
                    pause_for_write=options.pause_for_write,
                    version_label=options.version_label,
                )
                self._fvs_server_writer = writer
                return writer
            case other:
                raise ValueError(f"vLLM mode {other!r} is not supported; valid: 'colocate', 'server'")

    def _fvs_build(self, model: torch.nn.Module) -> None:
        """Detect the backend and build the sync for `model` (once per model object; none for DeepSpeed ZeRO, which
        keeps the trainer's own sync), agreed on every rank.

        Raises:
            SyncError: on every rank when the build failed on any (the engine is unchanged).
        """
        # NOTE: the control group first: creating it is a collective, so no rank may fail on its own before it (a
        # rank that raised there would leave the others waiting in it); every failure after it is agreed.
        coordinator = Coordinator(self.sync_config.sync_timeout_s)
        error: Exception | None = None
        backend: Backend | None = None
        sync: Sync | None = None
        try:
            fault_point("build")
            backend = detect_backend(model)
            if backend is not Backend.DEEPSPEED or self._fvs_builtin_sync is None:
                device = self.accelerator.device  # type: ignore[attr-defined]
                sync = build_sync(model, self._fvs_writer(), self.sync_config, device=device, backend=backend)
                # What the trainer moves when a sync commits (the async trainer's policy version), every rank.
                sync.on_publish = self._fvs_seam.publisher(self)
                if sync.serves_adapter:
                    writer = self._fvs_server_writer
                    kept = writer.kept_adapter_versions if writer is not None and writer.client is not None else None
                    refusal = self._fvs_seam.adapter_refusal(self, kept)
                    if refusal is not None:
                        raise UnsupportedSetupError(f"Adapter syncs with {type(self).__name__}: {refusal}.")
        except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
            error = e
        failures = coordinator.agree_on("build", error)
        if failures:
            raise agreed_error(error, failures, EngineState("unchanged") if self._fvs_target is not None else None)
        self._fvs_sync, self._fvs_model, self._fvs_backend = sync, model, backend
        if sync is not None and sync.serves_adapter:
            self._fvs_generate_with_adapter(sync)

    # --- adapter syncs (SyncConfig.adapter): generation asks for the adapter the last sync loaded ---

    def _fvs_generate_with_adapter(self, sync: Sync) -> None:
        """Make the trainer's colocated generation pass the current adapter's `LoRARequest` (TRL's generate calls
        pass none; see compat.trl_adapter). Server mode asks by the adapter's name (the writer's)."""
        target = self._fvs_target
        if target is None:
            return
        prefix = sync.adapter_prefix
        if prefix is not None and self._fvs_seam.serve_adapter(self, prefix):
            return
        if target.mode == "colocate" and target.llm is not None:
            ask_for_adapter(target.llm, sync.adapter_request)
        if target.mode == "server" and target.client is not None:
            ask_server_for_adapter(target.client, sync.adapter_request)

    def resync(self) -> None:
        """Make the next weight sync send every weight whole (complete, and dense with `SyncConfig(sparse=True)`).

        For after the engine's weights were changed outside this trainer where the engine cannot say so itself: a
        checkpoint loaded into it, or a restart of an engine without weight versions (where vLLM keeps one, every
        push stamps it and the next delta or sparse sync notices a restart by itself; docs/failures.md). Any rank may
        call it: the ranks agree at the next sync. Before the first sync it changes nothing (that one is complete).
        """
        if self._fvs_sync is not None:
            self._fvs_sync.resync()

    @property
    def engine_is_current(self) -> bool:
        """False after a failed sync until a sync succeeds: the engine may hold a mix of previous and new weights
        (`sync_reports[-1]` says which), and generation syncs first (see `_fvs_guard_generation`)."""
        return not self._fvs_stale

    def sync_weights_to_vllm(self) -> SyncReport | None:
        """Push the trainer's current weights into the vLLM engine; every rank must call it.

        Raises:
            SyncError: on every rank when the sync failed on any; the engine is then marked stale
                (`engine_is_current` is False, a failed `SyncReport` is recorded and logged) until a sync succeeds.
        """
        model = self.model_wrapped  # type: ignore[attr-defined]
        sync = self._fvs_sync
        try:
            if model is not self._fvs_model:
                self._fvs_build(model)
                sync = self._fvs_sync
            if sync is None:  # DeepSpeed ZeRO (`_fvs_build` builds nothing for it)
                assert self._fvs_builtin_sync is not None
                logger.warning("fsdp-vllm-sync: DeepSpeed ZeRO model; using the trainer's built-in weight sync.")
                self._fvs_builtin_sync()
                return None
            report = sync.sync()
        except SyncError as e:
            # NOTE: every rank gets here together (the error was agreed), so every rank marks its engine stale, even
            # one whose own push completed: the engines no longer hold the same weights.
            self._fvs_stale = True
            if e.engine is not None:
                engine = e.engine.status
            elif sync is not None and not sync.writer.pushes:
                # NOTE: server mode: only the main process writes; this rank's error says so where the others say
                # what their engine holds (the main process's report has the server's state).
                e.writes_no_engine = True
                engine = "none"
            else:
                engine = "unknown"
            failed = SyncReport.failed(
                e,
                engine,
                backend=sync.backend if sync is not None else "",
                strategy=sync.strategy if sync is not None else "",
                writer=sync.writer_kind if sync is not None else "",
            )
            self.sync_reports.append(failed)
            logger.error("%s", failed.summary())
            if self.sync_config.log_metrics:
                log_sync_metrics(self, failed.metrics())
            raise
        self._fvs_stale = False
        if self._fvs_target is not None and self._fvs_target.sleep_mode:
            mark_weights_awake(self._fvs_target)
        self.sync_reports.append(report)
        logger.info(report.summary())
        if self.sync_config.log_metrics:
            log_sync_metrics(self, report.metrics())
        return report

    def _fvs_guard_generation(self, owner: Any) -> None:
        """Make the trainer's vLLM generation sync first while the engine is stale.

        Why: TRL syncs only when `global_step` moved since its last sync, so after a failed sync (caught by the user,
        or a run resumed at the same step) it would generate from an engine holding a mix of old and new weights.
        """
        generate = owner.generate

        def generate_from_current_weights(*args: Any, **kwargs: Any) -> Any:
            if self._fvs_stale:
                logger.warning("fsdp-vllm-sync: the last weight sync failed; syncing before generating.")
                owner.sync_weights()  # the trainer's sync entry (ours, or whatever wraps it)
            return generate(*args, **kwargs)

        owner.generate = generate_from_current_weights


def _engine_for_adapters(config: SyncConfig, peft_config: Any) -> Any:
    """The context TRL's colocated engine is built in: with LoRA enabled where adapter syncs are required
    (`SyncConfig(adapter=True)`) and the trainer is given a LoRA config; as is otherwise."""
    import contextlib

    rank = peft_rank(peft_config) if config.adapter else None
    return engine_with_lora(rank) if rank is not None else contextlib.nullcontext()
