"""Adapter syncs (`SyncConfig.adapter`): push only a LoRA adapter's tensors into the engine's LoRA manager, in memory;
the engine keeps the base it loaded from its own checkpoint.

Why its own kind of the one sync (`frame.SyncFrame`), not a selection policy of `WeightSync`: nothing of the merged
path's steps applies. There is no engine
manifest to plan against (the engine's weights are never written), no gather of FSDP units (each rank hands over its
own part of each `lora_A`/`lora_B` and the parts are exchanged on the sync's own group (`adapter.pieces`): no base
parameter is ever unsharded), and the engine's writer is its LoRA manager. What it shares with `WeightSync` is the
frame: `sync()` on every rank in the same order (deadline, check_finite, push, verify, publish last), one
`SyncReport`, a failure on any rank raised on every rank (`distributed.agreed`, `Coordinator.run`), `resync()`.

Steps:
1. plan, once: the adapter's weights by trainer name, their PEFT checkpoint names, its config; what the engine
   cannot serve is refused before anything is written (`adapter_refusal`).
2. the base, once: every rank compares its own shards of the frozen base with the same elements of the engine's
   checkpoint (`torch.equal`; only the rows holding them are read; no gather); a different base is an error before
   anything is written.
3. every sync: this rank's pieces of the adapter (`Gatherer.held_pieces`, laid out with the plan) packed in one copy,
   exchanged (`pieces.PieceExchange`), built into an adapter that every rank agrees on (the full tensors are views
   of one buffer per dtype, named once per plan), then loaded into the engine beside the version it serves
   (`AdapterWriter.load_adapter`), verified, and published at the commit point (`publish_adapter`): only then do
   requests name it, and the previous version may be unloaded. Nothing per tensor is worked out again per sync.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_sync.compat.lora_api import (
    Adapter,
    adapter_rank,
    adapter_refusals,
    adapter_tensor_name,
    max_lora_rank_fix,
    peft_adapter_config,
)
from fsdp_sync.compat.names import Dropped, NameRules, canonical_name, unwrapped_name

from ..config import SyncConfig
from ..distributed import Coordinator, agreed
from ..errors import EngineState, NonFiniteWeightsError, RankFailure, SyncError, UnsupportedSetupError, agreed_error
from ..gather.base import Gatherer, Piece
from ..report import AdapterFigures, SyncReport
from ..writers.base import AdapterWriter, EngineWriter
from .frame import Pushed, SyncFrame, Verified
from .pieces import Packed, PieceExchange
from .pieces import few as _few
from .verify import verify_adapter

__all__ = ["AdapterPlan", "AdapterSync", "adapter_plan", "adapter_refusal"]

logger = logging.getLogger(__name__)

# The alternative every refusal of an adapter sync ends with (after the change that fixes the refusal itself).
FALLBACK = (
    "use merged syncs instead: SyncConfig(adapter=False), which push the whole model (a PEFT adapter merged into its "
    "base)"
)
@dataclass(frozen=True)
class AdapterPlan:
    """What an adapter sync sends, the same on every rank.

    Attributes:
        names: trainer names of the adapter's weights (`lora_A`, `lora_B`), in the gatherer's order.
        checkpoint: trainer name -> PEFT checkpoint name (what vLLM parses).
        base: trainer name -> checkpoint name of every other parameter (the frozen base).
        config: PEFT's adapter config as a dict.
        adapter_name: the adapter's name in the PEFT model.
        nbytes: the adapter's full tensors' bytes (what a sync sends).
    """

    names: tuple[str, ...]
    checkpoint: dict[str, str]
    base: dict[str, str]
    config: dict[str, Any]
    adapter_name: str
    nbytes: int


def adapter_plan(model: torch.nn.Module, gatherer: Gatherer, rules: NameRules) -> AdapterPlan:
    """The adapter plan of a PEFT model (as the user built it) and its gatherer; ValueError for what is not one
    servable LoRA adapter on a frozen base (every reason at once)."""
    adapter_name, config = peft_adapter_config(model)
    specs = gatherer.specs()
    trainable = gatherer.trainable()
    checkpoint: dict[str, str] = {}
    base: dict[str, str] = {}
    other_adapters: list[str] = []
    for name in specs:
        unwrapped = unwrapped_name(name, rules)
        target = adapter_tensor_name(unwrapped, adapter_name)
        if target is not None:
            checkpoint[name] = target
            continue
        mapped = canonical_name(name, rules)
        if isinstance(mapped, Dropped):
            other_adapters.append(name)  # DoRA magnitudes, embedding adapters, another adapter's weights
        else:
            base[name] = mapped
    reasons = []
    if other_adapters:
        reasons.append(
            f"adapter weights other than lora_A/lora_B: {_few(other_adapters)} (an adapter sync sends a LoRA "
            "adapter's lora_A/lora_B alone: no DoRA, embedding or second adapter)"
        )
    moving = sorted(n for n in base if n in trainable)
    if moving:
        reasons.append(
            f"trainable parameters outside the adapter (the engine's base would go stale): {_few(moving)} (freeze "
            "them: requires_grad=False)"
        )
    if not checkpoint:
        reasons.append("the model has no lora_A/lora_B weights")
    if reasons:
        raise ValueError("; ".join(reasons))
    nbytes = sum(math.prod(specs[n].shape) * specs[n].dtype.itemsize for n in checkpoint)
    return AdapterPlan(tuple(checkpoint), checkpoint, base, config, adapter_name, nbytes)


def adapter_refusal(
    model: torch.nn.Module, gatherer: Gatherer, rules: NameRules, writer: EngineWriter
) -> str | None:
    """Why this model's adapter cannot be pushed as an adapter into `writer`'s engine (None: it can), with the change
    that fixes each reason where one does (the caller adds the merged fallback, `FALLBACK`)."""
    if not rules.peft:
        return (
            "the model has no PEFT adapter: drop adapter=True (the default pushes the whole model), or give the "
            "trainer the base model and peft_config=LoraConfig(...) (or wrap the model with PEFT) to push an adapter"
        )
    if not isinstance(writer, AdapterWriter):
        return f"the {writer.kind} writer does not load adapters"
    transport = writer.adapter_transport_refusal()
    if transport is not None:
        return transport
    server = not writer.engine_per_rank
    try:
        _, config = peft_adapter_config(model)
    except ValueError as e:
        return str(e)
    # NOTE: on every rank (a server's configuration is known to all), so that every rank decides alike.
    limits = writer.lora_limits()
    if limits is None:
        fix = max_lora_rank_fix(adapter_rank(config), server=server, enable_lora=True)
        if server:
            return f"the vLLM server was started without LoRA: {fix}"
        # NOTE: TRL builds a colocated engine with LoRA only when the trainer is given `peft_config=` (a model
        # wrapped in PEFT beforehand gets an engine without it); users of TRL cannot pass `enable_lora` themselves.
        return (
            "the vLLM engine was started without LoRA (with TRL: pass `peft_config=` to the trainer instead of a "
            f"model wrapped in PEFT beforehand; your own `vllm.LLM`: {fix})"
        )
    reasons: list[str] = []
    targeted: set[str] = set()
    try:
        plan = adapter_plan(model, gatherer, rules)
        targeted = {name.split(".")[-3] for name in plan.checkpoint.values()}
    except ValueError as e:
        reasons.append(str(e))
    reasons = adapter_refusals(config, limits, targeted, server=server) + reasons
    return "; ".join(reasons) if reasons else None


def base_mismatches(plan: AdapterPlan, pieces: Iterable[Piece], checkpoint_dir: str) -> list[str]:
    """This rank's frozen-base pieces against the same elements of the engine's checkpoint, compared with
    `torch.equal` (local work: each rank reads from the files only the rows that hold its own elements, of the
    tensors it holds part of; the files are closed on return)."""
    from safetensors import safe_open

    files = _checkpoint_files(checkpoint_dir)
    problems: list[str] = []
    with contextlib.ExitStack() as opened:
        handles: dict[Path, Any] = {}
        for piece in pieces:
            n = piece.values.numel()
            if not n:
                continue
            target = plan.base[piece.name]
            path = files.get(target)
            if path is None:
                problems.append(f"{target}: not in the engine's checkpoint")
                continue
            handle = handles.get(path)
            if handle is None:
                handle = handles[path] = opened.enter_context(safe_open(str(path), framework="pt"))
            stored = _stored_elements(handle, target, piece.start, n).to(piece.values.dtype)
            if not torch.equal(stored, piece.values.detach().reshape(-1).to(stored.device)):
                problems.append(f"{target}: differs from the trainer's frozen base")
    return problems


def _stored_elements(handle: Any, name: str, start: int, count: int) -> torch.Tensor:
    """Elements `[start, start + count)` of tensor `name` flattened, reading only the rows (first-dimension slices)
    that hold them."""
    view = handle.get_slice(name)
    shape = view.get_shape()
    if not shape:  # a scalar
        return handle.get_tensor(name).reshape(-1)[start : start + count]
    row = math.prod(shape[1:])
    first, last = start // row, (start + count - 1) // row + 1
    rows = view[first:last].reshape(-1)
    offset = start - first * row
    return rows[offset : offset + count]


def _check_finite(exchange: PieceExchange, packed: Packed) -> None:
    """`SyncConfig(check_finite=True)`: this rank's packed pieces of the adapter hold no NaN or Inf (local work,
    before they are exchanged; one pass per dtype, names looked up only when one is found).

    Raises:
        NonFiniteWeightsError: naming every adapter weight that holds one; nothing was sent.
    """
    if all(bool(torch.isfinite(values).all()) for values in packed.values() if values.is_floating_point()):
        return
    bad = sorted({name for name, values in exchange.named_values(packed) if not bool(torch.isfinite(values).all())})
    raise NonFiniteWeightsError(
        f"NaN or Inf in {len(bad)} adapter weight(s) on this rank: {_few(bad, 8)}; nothing was sent (the engine "
        "keeps the previous adapter). Training has diverged: look at the loss and the learning rate."
    )


def _checkpoint_files(checkpoint_dir: str) -> dict[str, Path]:
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), path))
    if not files:
        raise FileNotFoundError(f"no safetensors files in the engine's checkpoint {checkpoint_dir}")
    return files


class AdapterSync(SyncFrame):
    """Pushes the trainer's LoRA adapter into the engine on each `sync()` (the frame's); every rank calls it.

    Each sync's adapter is a new version, loaded beside the one generation is served (`AdapterWriter.load_adapter`:
    staged), verified, and only at the commit point published (`publish_adapter`: requests name it, the previous
    one may be evicted). A failure before that drops the staged version (`abandon_adapter`): requests keep naming
    the previous one, still loaded. A failed version's number is taken again by the retry; the writers make sure
    nothing the engine computed with the failed contents is ever served under that name (docs/adapters.md).

    Args:
        model: the PEFT model as the user built it (its adapter config).
        gatherer: this trainer's gatherer (only its metadata and `local_pieces` are used: nothing is unsharded).
        writer: an `AdapterWriter` (or, on a rank that writes into no engine, any writer with `pushes` False).
        config: the sync's options (`sync_timeout_s`).
        rules: the model's name rules.
        backend: the detected backend's name, for reports.
        name_prefix: adapter names in the engine are `<prefix>-v<N>`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        gatherer: Gatherer,
        writer: EngineWriter,
        config: SyncConfig,
        *,
        rules: NameRules,
        backend: str = "",
        name_prefix: str = "fsdp-vllm-sync",
    ) -> None:
        self._frame(config, writer, Coordinator(config.sync_timeout_s), backend)
        self.model = model
        self.gatherer = gatherer
        self.rules = rules
        self.name_prefix = name_prefix
        # The adapter version published last (what requests name); moves only at the commit point.
        self.version = 0
        self._plan: AdapterPlan | None = None
        # Made with the first sync's pieces (inside its agreement: a rank that cannot lay its pieces out raises
        # there, on every rank), with the checkpoint names of its full tensors, in its order.
        self._exchange: PieceExchange | None = None
        self._keys: tuple[str, ...] = ()
        # This sync's pieces, packed once (by the finite check, or by the push).
        self._packed: Packed | None = None
        self._base_seconds = 0.0
        self._first = True

    # --- the `contract.Sync` the mixin drives ---

    strategy = "adapter-pieces"
    serves_adapter = True

    @property
    def adapter_prefix(self) -> str:
        return self.name_prefix

    sync_plan = None  # an adapter sync's plan is its `AdapterPlan` (`checked_plan`)

    @property
    def writer_kind(self) -> str:
        """Where the adapter goes: a colocated engine's LoRA manager, or the server's over its transfer."""
        return "colocate:lora_manager" if self.writer.engine_per_rank else self.writer.kind

    @property
    def checked_plan(self) -> AdapterPlan | None:
        """The plan once its base was checked (first sync), else None."""
        return self._plan

    def resync(self) -> None:
        """Nothing to forget: every adapter sync sends the whole adapter."""

    def adapter_request(self) -> object | None:
        """The `LoRARequest` generation must pass for the adapter published last (None before the first sync, and
        on a rank without an engine)."""
        return self.writer.adapter_request() if isinstance(self.writer, AdapterWriter) and self.writer.pushes else None

    def _unchanged(self) -> EngineState | None:
        return EngineState("unchanged", version=self._served()) if self.writer.pushes else None

    def _failed_stage(self, e: Exception | None, failures: list[RankFailure]) -> SyncError:
        return agreed_error(e, failures, self._unchanged())

    def plan(self) -> AdapterPlan:
        """The plan, checked once on every rank: servable, and the engine's checkpoint holds the trainer's base.

        Raises:
            UnsupportedSetupError: on every rank, before anything is written, naming the reason and the fallback.
        """
        if self._plan is None:
            started = time.perf_counter()
            plan = agreed(self.coordinator, "adapter.plan", self._make_plan, self._failed_stage)
            self._base_seconds = time.perf_counter() - started
            self._plan = plan
        return self._plan

    def _make_plan(self) -> AdapterPlan:
        refusal = adapter_refusal(self.model, self.gatherer, self.rules, self.writer)
        if refusal is not None:
            raise UnsupportedSetupError(f"This adapter cannot be pushed as an adapter: {refusal}; {FALLBACK}.")
        plan = adapter_plan(self.model, self.gatherer, self.rules)
        if isinstance(self.writer, AdapterWriter):
            mismatched = base_mismatches(plan, self.gatherer.local_pieces(plan.base), self.writer.base_checkpoint())
            if mismatched:
                raise UnsupportedSetupError(
                    f"The engine's base is not the trainer's frozen base ({len(mismatched)} tensor(s): "
                    f"{_few(mismatched)}); an adapter pushed onto it would be served on other weights. Start the "
                    f"engine from the trainer's base checkpoint, or {FALLBACK}. Nothing was written."
                )
        return plan

    def _adapter(self, plan: AdapterPlan, full: list[torch.Tensor], version: int) -> Adapter | None:
        """Version `version` of the adapter from the exchanged tensors (None on a rank that loads no engine)."""
        if not self.writer.pushes:
            return None
        return Adapter(version, f"{self.name_prefix}-v{version}", dict(zip(self._keys, full, strict=True)), plan.config)

    # --- the steps of `frame.SyncFrame.sync` ---

    def _checked_plan(self) -> AdapterPlan:
        self._first = self._plan is None
        self._packed = None
        return self.plan()

    def _pack(self, plan: AdapterPlan) -> tuple[PieceExchange, Packed]:
        """The exchange, and this rank's pieces of the adapter packed for it, once per sync (local work, no
        collective); the exchange is laid out at the first sync."""
        if self._exchange is None:
            specs = self.gatherer.specs()
            exchange = PieceExchange(
                plan.names, [specs[n].shape for n in plan.names], [specs[n].dtype for n in plan.names],
                self.gatherer.held_pieces,
            )  # fmt: skip
            self._exchange, self._keys = exchange, tuple(plan.checkpoint[n] for n in exchange.order)
        if self._packed is None:
            self._packed = self._exchange.pack()
        return self._exchange, self._packed

    def _check_finite(self, plan: AdapterPlan) -> None:
        agreed(self.coordinator, "check", lambda: _check_finite(*self._pack(plan)), self._failed_stage)

    def _push(self, plan: AdapterPlan) -> Pushed:
        start = time.perf_counter()
        version = self.version + 1
        try:
            # NOTE: on the sync's own group, not the training group: a rank that raises inside the exchange (in
            # listing its pieces, or in building the full tensors after it) aborts that group, so every rank raises
            # at once naming it, where the training group would have kept the others inside its all-gather until
            # that group's own timeout.
            def exchanged(group: Any) -> list[torch.Tensor]:
                exchange, packed = self._pack(plan)
                return exchange(packed, receive=self.writer.pushes, group=group)

            full = self.coordinator.run("adapter.pieces", exchanged)
            # NOTE: every rank agrees before any engine loads: a rank that raised just after the exchange's last
            # all-gather returned (the others had left it) would otherwise leave their engines on the new version.
            adapter = agreed(
                self.coordinator, "adapter.pieces", lambda: self._adapter(plan, full, version), self._failed_stage
            )
        except SyncError as e:
            e.engine = e.engine or self._unchanged()
            raise
        finally:
            self._packed = None
        error: Exception | None = None
        if adapter is not None:
            try:
                self.writer.load_adapter(adapter)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
                error = e
        failures = self.coordinator.agree_on("push", error)
        staged = None
        if adapter is not None:
            staged = EngineState(
                "unchanged",
                note=f"adapter {adapter.name} was loaded beside it and is dropped: requests still name the previous one",
                version=self._served(),
            )
        if failures:
            raise agreed_error(error, failures, staged)
        return Pushed(staged, time.perf_counter() - start, adapter)

    def _verify(self, pushed: Pushed) -> Verified:
        started = time.perf_counter()
        checked = verify_adapter(self.coordinator, self.writer, pushed.detail, pushed.engine)  # type: ignore[arg-type]
        return Verified(checked, 0, time.perf_counter() - started)

    def _commit(self, pushed: Pushed) -> str | None:
        adapter: Adapter = pushed.detail
        self.writer.publish_adapter(adapter)  # type: ignore[attr-defined]
        return adapter.name

    def _served(self) -> str | None:
        return f"{self.name_prefix}-v{self.version}" if self.version else None

    def _published(self, pushed: Pushed) -> int | None:
        return self.version

    def _landed(self, pushed: Pushed) -> None:
        self.version += 1

    def _abandon(self) -> None:
        if self.writer.pushes and isinstance(self.writer, AdapterWriter):
            self.writer.abandon_adapter()

    def _report(self, pushed: Pushed, verified: Verified | None) -> SyncReport:
        plan = self.plan()
        return SyncReport(
            seconds=pushed.seconds,
            bytes=plan.nbytes if pushed.detail is not None else 0,
            tensors=len(plan.names),
            peak_extra_bytes=plan.nbytes,
            memory_source="accounted",
            backend=self.backend,
            strategy=self.strategy,
            writer=self.writer_kind,
            verified=verified.checked if verified is not None else None,
            verify_seconds=verified.seconds if verified is not None else 0.0,
            figures=(
                AdapterFigures(
                    adapter_id=self.version,
                    adapter_tensors=len(plan.names),
                    base_checked_seconds=self._base_seconds if self._first else 0.0,
                ),
            ),
        )
