"""Sparse syncs in `WeightSync` (one process, fakes): what is sent as patches and what whole, the density threshold
and NaN rules widened to whole engine modules, the snapshot's life (taken after a dense sync, dropped after a failed
one), the engine's refusals, and `SyncConfig` / wire checks. The real engine and server: tests/e2e/test_sparse.py
and tests/e2e/test_server_sparse.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor, TensorSpec
from fsdp_sync.compat.patch_api import EnginePatch
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import SyncError
from fsdp_sync.memory import MemoryMeter
from fsdp_sync.report import SparseFigures, SyncReport
from fsdp_sync.assemble import policy_for
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.gather.base import Piece, replica_piece
from fsdp_sync.sync.patches import Patch, count_changes, gather_patches
from fsdp_sync.sync.sparse import patchable_tensors
from fsdp_sync.transfer.gloo import GlooUpdateInfo

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"
O = "model.layers.0.self_attn.o_proj.weight"
Q1, K1, V1, O1 = (n.replace("layers.0", "layers.1") for n in (Q, K, V, O))
NORM = "model.norm.weight"
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
MODULES = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("qkv_proj", "o_proj")] + ["model.norm"]


class Gatherer:
    """One process: every parameter whole, its piece the whole tensor."""

    strategy = "fake"
    tensors_outlive_step = True

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def iter_full(self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: object = None) -> Iterator:
        for name, t in self.tensors.items():
            if select is None or name in select:
                yield name, t

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = None if names is None else set(names)
        yield from ((n, t) for n, t in self.tensors.items() if wanted is None or n in wanted)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        return (replica_piece(n, self.tensors[n], True) for n in names)

    def trainable(self) -> frozenset[str]:
        return frozenset(self.tensors)


class Engine:
    """Holds bf16 weights by checkpoint name; takes whole tensors and patches, and can refuse or fail."""

    kind = "fake:engine"
    pushes = True
    engine_dtype = torch.bfloat16
    retains_tensors = False
    engine_per_rank = True

    def __init__(self, tensors: dict[str, torch.Tensor], *, refuse: str | None = None) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.specs = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        self.refuse = refuse
        self.fail_patches = False
        self.writes: list[list[str]] = []
        self.patches: list[list[str]] = []

    def manifest(self) -> EngineManifest:
        return EngineManifest(tensors=self.specs, engine_dtype=self.engine_dtype, source="fake")

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        pass

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        names = []
        for name, t in weights:
            self.weights[name] = t.clone()
            names.append(name)
        self.writes.append(names)

    def write_patches(self, patches: Sequence[EnginePatch]) -> None:
        if self.fail_patches:
            raise RuntimeError("the engine refused the patches")
        self.patches.append([p.name for p in patches])
        for p in patches:
            self.weights[p.name].view(-1)[p.indices] = p.values

    def finish(self) -> None:
        pass

    def engine_layout(self) -> EngineLayout:
        return EngineLayout(EngineNaming(PACKED), frozenset(MODULES))

    def sparse_refusal(self) -> str | None:
        return None

    def patch_refusals(self) -> dict[str, str]:
        return {} if self.refuse is None else {self.refuse: "quantized (fake)"}


def _model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(64, 64) for n in (Q, K, V, O, Q1, K1, V1, O1)} | {NORM: torch.randn(64)}


def _step(tensors: dict[str, torch.Tensor], fraction: dict[str, float]) -> None:
    """Change about `fraction` of each named tensor's bf16 values (by 10%: always a bf16 change)."""
    for name, f in fraction.items():
        flat = tensors[name].view(-1)
        k = int(flat.numel() * f)
        flat[:k] *= 1.1


def _exact(engine: Engine, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        assert torch.equal(engine.weights[name], t.to(torch.bfloat16)), name


def _config(**kw: object) -> SyncConfig:
    return SyncConfig(sparse=True, check_manifest=False, **kw)  # type: ignore[arg-type]


def _sparse(report: SyncReport) -> SparseFigures:
    """The report's sparse figures (a sync with `SyncConfig(sparse=True)` always has them)."""
    figures = report.figure(SparseFigures)
    assert figures is not None
    return figures


def test_dense_first_then_patches_and_dense_over_the_threshold_with_its_engine_module() -> None:
    tensors = _model()
    engine = Engine(tensors)
    sync = WeightSync(Gatherer(tensors), engine, _config(sparse_max_density=0.1), policy=policy_for)
    first = sync.sync()
    assert first.complete and not first.sparse
    assert _sparse(first).snapshot_bytes == sum(t.numel() * 2 for t in tensors.values())
    _exact(engine, tensors)
    _step(tensors, {Q: 0.01, K: 0.5, O: 0.02, NORM: 0.05})
    second = sync.sync()
    # Layer 0's qkv module changed over the threshold ((1% + 50% + 0) / 3): it goes whole (Q and V with K); the rest
    # as patches (a tensor without a change has no patch: nothing to write).
    assert second.sparse and engine.writes[-1] == [Q, K, V] and engine.patches[-1] == [O, NORM]
    figures = _sparse(second)
    assert figures.patched_tensors == 6 and second.tensors == 3 and figures.patch_bytes > 0
    assert figures.changed_elements == int(4096 * 0.01) + int(4096 * 0.5) + int(4096 * 0.02) + int(64 * 0.05)
    assert figures.diffed_elements == 8 * 4096 + 64 and figures.patched_elements == 5 * 4096 + 64
    _exact(engine, tensors)
    _step(tensors, {Q: 0.01})
    third = sync.sync()
    assert third.sparse and engine.patches[-1] == [Q] and len(engine.writes) == 2  # nothing whole, no write call
    assert _sparse(third).patched_tensors == 9 and _sparse(third).changed_elements == int(4096 * 0.01)
    _exact(engine, tensors)


def test_a_sync_that_goes_mostly_whole_backs_off_to_dense_syncs_then_tries_again() -> None:
    from fsdp_sync.sync.sparse import BACKOFF_SYNCS

    tensors = _model()
    engine = Engine(tensors)
    sync = WeightSync(Gatherer(tensors), engine, _config(sparse_max_density=0.1), policy=policy_for)
    sync.sync()
    kinds = []
    for _ in range(BACKOFF_SYNCS + 2):
        _step(tensors, {n: 0.5 for n in tensors} if not kinds else {O: 0.01})
        report = sync.sync()
        kinds.append((report.sparse, _sparse(report).snapshot_bytes > 0))
        _exact(engine, tensors)
    # The sparse sync that went whole, BACKOFF_SYNCS dense syncs (the last one takes the snapshot again), sparse.
    assert kinds == [(True, False)] + [(False, False)] * (BACKOFF_SYNCS - 1) + [(False, True), (True, True)], kinds


def test_a_nan_goes_whole_never_as_a_patch() -> None:
    """vLLM's patch loader reads NaN as "unchanged": a tensor whose new values hold one goes whole."""
    tensors = _model()
    engine = Engine(tensors)
    sync = WeightSync(Gatherer(tensors), engine, _config(), policy=policy_for)
    sync.sync()
    tensors[NORM][3] = float("nan")
    report = sync.sync()
    assert report.sparse and engine.writes[-1] == [NORM] and engine.patches == []
    assert torch.isnan(engine.weights[NORM][3])


def test_a_tensor_the_engine_cannot_patch_goes_whole_with_its_module_every_time() -> None:
    tensors = _model()
    engine = Engine(tensors, refuse="model.layers.0.self_attn.qkv_proj.weight")
    sync = WeightSync(Gatherer(tensors), engine, _config(), policy=policy_for)
    sync.sync()
    _step(tensors, {O: 0.01, V: 0.01})
    report = sync.sync()
    assert report.sparse and engine.writes[-1] == [Q, K, V] and engine.patches[-1] == [O]
    assert _sparse(report).patched_tensors == 6  # every tensor but layer 0's q, k and v
    _exact(engine, tensors)


def test_a_failed_patch_push_drops_the_snapshot_and_the_next_sync_is_complete() -> None:
    tensors = _model()
    engine = Engine(tensors)
    sync = WeightSync(Gatherer(tensors), engine, _config(), policy=policy_for)
    sync.sync()
    _step(tensors, {O: 0.01})
    engine.fail_patches = True
    with pytest.raises(SyncError, match="refused the patches"):
        sync.sync()
    engine.fail_patches = False
    engine.weights[O].zero_()  # whatever the failure left
    retry = sync.sync()
    assert retry.complete and not retry.sparse
    _exact(engine, tensors)
    _step(tensors, {O: 0.01})
    assert sync.sync().sparse
    _exact(engine, tensors)


def test_patchable_tensors_says_why_each_other_tensor_goes_whole() -> None:
    spec = TensorSpec((4, 4), torch.float32)
    tensors = [
        PlannedTensor("a.weight", spec, ("t.a.weight",)),
        PlannedTensor("b.weight", TensorSpec((4, 4), torch.int64), ("t.b.weight",)),
        PlannedTensor("experts.gate_up", TensorSpec((2, 4, 4), torch.float32), ("t.e0", "t.e1")),
        PlannedTensor("c.weight", spec, ("t.c.weight",)),
        PlannedTensor("d.weight", spec, ("t.d.weight",)),
    ]
    targets = {"t.a.weight": "a.weight", "t.b.weight": "b.weight", "t.c.weight": "c.weight", "t.d.weight": "d.weight"}
    shapes = {"t.a.weight": (4, 4), "t.b.weight": (4, 4), "t.c.weight": (4, 4), "t.d.weight": (16,)}
    ok, why = patchable_tensors(tensors, targets, shapes, {"c.weight": "fp8"})
    assert ok == {"a.weight"}
    assert "not floating point" in why["b.weight"]
    assert "converted" in why["experts.gate_up"] and "converted" in why["d.weight"]
    assert "fp8" in why["c.weight"]


def test_counts_subset_and_gather_with_given_counts() -> None:
    local = {
        "a": Patch(torch.tensor([1, 5]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)),
        "b": Patch(torch.tensor([0]), torch.tensor([float("nan")], dtype=torch.bfloat16)),
    }
    counts = count_changes(["a", "b", "c"], local)
    assert counts.totals == [2, 1, 0] and counts.nan == (False, True, False)
    kept = counts.subset(["a", "c"])
    joined = gather_patches(["a", "c"], local, [torch.bfloat16] * 2, [8, 8], to_all=True, counts=kept)
    assert list(joined.patches) == ["a"] and joined.patches["a"].indices.tolist() == [1, 5]
    with pytest.raises(ValueError, match="exactly"):
        gather_patches(["a"], local, [torch.bfloat16], [8], to_all=True, counts=counts)


def test_config_and_wire_checks() -> None:
    with pytest.raises(ValueError, match="delta"):
        SyncConfig(sparse=True, delta=False)
    with pytest.raises(ValueError, match="sparse_max_density"):
        SyncConfig(sparse_max_density=1.5)
    info = GlooUpdateInfo(names=["w"], dtype_names=["bfloat16"], shapes=[[70000]], counts=[3])
    assert info.segment_sizes() == [4 * 2, 2 * 3, 2 * 3]  # two 2^16-element blocks, 3 indices, 3 values
    with pytest.raises(ValueError, match="counts"):
        GlooUpdateInfo(names=["w"], dtype_names=["bfloat16"], shapes=[[4]], counts=[1, 2])


class DigestEngine(Engine):
    """The engine above, unfused, with the sha256 digests of what it holds (what `verify` compares)."""

    def engine_layout(self) -> EngineLayout:
        return EngineLayout(EngineNaming(), frozenset(n.rpartition(".")[0] for n in self.specs))

    def engine_digests(self) -> tuple[dict[str, dict[str, str]], bool]:
        import hashlib

        from fsdp_sync.sync.verify import tensor_bytes

        return {"": {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in self.weights.items()}}, False


def test_verify_gathers_the_patched_tensors_for_their_digests_and_the_report_counts_only_what_went_whole() -> None:
    """Regression (a tensor-parallel server's e2e run): with `verify`, a sync that sent only patches reported every
    patched tensor gathered for its digest as sent (723200 bytes, 26 tensors). `tensors` and `bytes` are what went
    whole; `verify` still compares every engine weight."""
    tensors = _model()
    engine = DigestEngine(tensors)
    sync = WeightSync(Gatherer(tensors), engine, _config(verify=True), policy=policy_for)
    first = sync.sync()
    assert first.tensors == len(tensors) and first.verified == len(tensors)
    _step(tensors, {Q: 0.01, O: 0.02})
    second = sync.sync()
    assert second.sparse and engine.patches[-1] == [Q, O] and len(engine.writes) == 1
    assert second.tensors == 0 and second.bytes == 0, (second.tensors, second.bytes)
    assert second.verified == len(tensors) and second.unverifiable == 0
    # per patch: one block's count (4 bytes), then 2 bytes of index and 2 of bf16 value per change
    assert _sparse(second).encoded_bytes == sum(4 + 4 * c for c in (int(4096 * 0.01), int(4096 * 0.02)))
    _exact(engine, tensors)
