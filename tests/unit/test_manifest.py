"""Unit tests for `compat.manifest.check_plan`: every error class alone, together, and optional names."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.compat.manifest import EngineManifest, ManifestError, PlannedTensor, TensorSpec, check_plan

F32 = torch.float32
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _manifest(**overrides: object) -> EngineManifest:
    """A fake engine: embedding, norm, an int buffer; `lm_head.weight` optional (tied)."""
    tensors = {
        EMBED: TensorSpec((16, 8), torch.bfloat16),
        NORM: TensorSpec((8,), torch.bfloat16),
        "model.positions": TensorSpec((4,), torch.int64),
        LM_HEAD: TensorSpec((16, 8), torch.bfloat16),
    }
    kwargs: dict[str, object] = dict(tensors=tensors, optional=frozenset({LM_HEAD}), source="fake-engine")
    kwargs.update(overrides)
    return EngineManifest(**kwargs)  # type: ignore[arg-type]


def _planned(name: str, shape: tuple[int, ...], dtype: torch.dtype = F32, source: str | None = None) -> PlannedTensor:
    return PlannedTensor(name, TensorSpec(shape, dtype), (source or f"trainer.{name}",))


def _good_plan() -> list[PlannedTensor]:
    return [
        _planned(EMBED, (16, 8)),
        _planned(NORM, (8,)),
        _planned("model.positions", (4,), torch.int64),
    ]


def _error(plan: list[PlannedTensor], manifest: EngineManifest | None = None) -> str:
    with pytest.raises(ManifestError) as info:
        check_plan(plan, manifest or _manifest())
    return str(info.value)


def test_tensor_spec_numel_and_nbytes() -> None:
    """`TensorSpec` derives element count and byte size from shape and dtype."""
    spec = TensorSpec((3, 4), torch.bfloat16)
    assert spec.numel == 12
    assert spec.nbytes == 24
    assert TensorSpec((), torch.float32).numel == 1


def test_matching_plan_passes() -> None:
    """A plan with every required name, right shapes and compatible dtypes raises nothing."""
    assert check_plan(_good_plan(), _manifest()) is None


def test_manifest_error_is_value_error() -> None:
    """`ManifestError` is a `ValueError`, so callers catching ValueError see it."""
    assert issubclass(ManifestError, ValueError)


def test_unknown_name_alone() -> None:
    """A name the engine does not have is reported with its trainer source; nothing else is."""
    plan = [*_good_plan(), _planned("model.extra.weight", (2,), source="module.model.extra.weight")]
    msg = _error(plan)
    assert "1 name(s) the engine does not have" in msg
    assert "model.extra.weight  (from module.model.extra.weight)" in msg
    assert "fake-engine" in msg
    assert "does not send" not in msg
    assert "more than once" not in msg
    assert "mismatch" not in msg


def test_missing_name_alone() -> None:
    """A required engine weight the plan lacks is reported as missing (it would stay stale)."""
    plan = [p for p in _good_plan() if p.name != NORM]
    msg = _error(plan)
    assert "1 engine weight(s) the trainer does not send" in msg
    assert f"  {NORM}" in msg
    assert "does not have" not in msg
    assert "mismatch" not in msg


def test_duplicate_name_alone() -> None:
    """A name sent twice is reported once, with both trainer sources."""
    plan = [*_good_plan(), _planned(NORM, (8,), source="second.norm")]
    msg = _error(plan)
    assert "1 name(s) sent more than once" in msg
    assert f"{NORM}  (from trainer.{NORM}, second.norm)" in msg
    assert "does not have" not in msg
    assert "does not send" not in msg


def test_shape_mismatch_alone() -> None:
    """A shape differing from the engine's is reported with both shapes."""
    plan = [_planned(EMBED, (8, 16)), *_good_plan()[1:]]
    msg = _error(plan)
    assert "1 shape mismatch(es)" in msg
    assert f"{EMBED}: trainer (8, 16) vs engine (16, 8)" in msg
    assert "dtype mismatch" not in msg


def test_float_to_float_dtype_allowed() -> None:
    """Any floating dtype may be sent for a floating engine weight (the pipeline casts it)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        plan = [_planned(EMBED, (16, 8), dtype), *_good_plan()[1:]]
        assert check_plan(plan, _manifest()) is None


def test_int_vs_float_dtype_rejected() -> None:
    """An integer tensor for a floating engine weight, or the reverse, is a dtype mismatch."""
    plan = [_planned(EMBED, (16, 8), torch.int32), _planned(NORM, (8,)), _planned("model.positions", (4,), F32)]
    msg = _error(plan)
    assert "2 dtype mismatch(es)" in msg
    assert f"{EMBED}: trainer torch.int32 vs engine torch.bfloat16" in msg
    assert "model.positions: trainer torch.float32 vs engine torch.int64" in msg
    assert "shape mismatch" not in msg


def test_int_dtype_must_match_exactly() -> None:
    """Integer dtypes must match exactly (int32 for an int64 engine buffer is rejected)."""
    plan = [*_good_plan()[:2], _planned("model.positions", (4,), torch.int32)]
    msg = _error(plan)
    assert "model.positions: trainer torch.int32 vs engine torch.int64" in msg


def test_bool_dtype_must_match_exactly() -> None:
    """A bool engine tensor accepts only bool."""
    manifest = EngineManifest(tensors={"mask": TensorSpec((2,), torch.bool)})
    assert check_plan([_planned("mask", (2,), torch.bool)], manifest) is None
    with pytest.raises(ManifestError, match="mask: trainer torch.uint8 vs engine torch.bool"):
        check_plan([_planned("mask", (2,), torch.uint8)], manifest)


def test_all_classes_in_one_error() -> None:
    """Every class of problem is reported together in one error, listing every offender and trainer sources."""
    plan = [
        _planned(EMBED, (16, 9), source="fsdp.embed"),  # shape
        _planned("model.positions", (4,), F32),  # dtype
        _planned("model.extra.a", (1,), source="src.a"),  # unknown
        _planned("model.extra.b", (1,), source="src.b"),  # unknown
        _planned(EMBED, (16, 9), source="fsdp.embed.again"),  # duplicate
        # NORM missing
    ]
    msg = _error(plan)
    assert msg.startswith("Weight sync plan does not match the engine (fake-engine); nothing was written.")
    assert "2 name(s) the engine does not have" in msg
    assert "model.extra.a  (from src.a)" in msg
    assert "model.extra.b  (from src.b)" in msg
    assert "1 engine weight(s) the trainer does not send" in msg
    assert f"  {NORM}" in msg
    assert "1 name(s) sent more than once" in msg
    assert f"{EMBED}  (from fsdp.embed, fsdp.embed.again)" in msg
    assert f"{EMBED}: trainer (16, 9) vs engine (16, 8)" in msg
    assert "model.positions: trainer torch.float32 vs engine torch.int64" in msg
    assert "Hint:" in msg
    # The optional tied head is neither missing nor unknown.
    assert LM_HEAD not in msg


def test_all_offenders_listed_not_only_first() -> None:
    """With many missing names, every one is listed (not truncated to the first)."""
    tensors = {f"w{i}": TensorSpec((1,), F32) for i in range(30)}
    msg = _error([], EngineManifest(tensors=tensors))
    assert "30 engine weight(s) the trainer does not send" in msg
    assert all(f"  w{i}\n" in msg + "\n" for i in range(30))


def test_optional_name_not_required() -> None:
    """An optional engine name absent from the plan is not reported missing."""
    assert check_plan(_good_plan(), _manifest()) is None  # lm_head.weight is in tensors but optional


def test_optional_name_not_unknown() -> None:
    """An optional name sent by the trainer is accepted, even when absent from `tensors`."""
    manifest = _manifest(optional=frozenset({LM_HEAD, "model.rotary.inv_freq"}))
    plan = [*_good_plan(), _planned(LM_HEAD, (16, 8)), _planned("model.rotary.inv_freq", (4,))]
    assert check_plan(plan, manifest) is None


def test_optional_name_sent_is_still_shape_checked() -> None:
    """An optional name that is sent and has an engine spec is still checked for shape."""
    msg = _error([*_good_plan(), _planned(LM_HEAD, (8, 16))])
    assert f"{LM_HEAD}: trainer (8, 16) vs engine (16, 8)" in msg


def test_without_optional_lm_head_is_required() -> None:
    """The same name is reported missing when the manifest does not mark it optional."""
    msg = _error(_good_plan(), _manifest(optional=frozenset()))
    assert f"  {LM_HEAD}" in msg
    assert "1 engine weight(s) the trainer does not send" in msg


def test_plan_may_be_a_generator() -> None:
    """`check_plan` accepts any iterable, consumed once."""
    assert check_plan((p for p in _good_plan()), _manifest()) is None
    with pytest.raises(ManifestError):
        check_plan((p for p in _good_plan()[:1]), _manifest())


def test_fp8_storage_must_match_exactly() -> None:
    """An FP8-stored engine weight (quantized storage) accepts only its own dtype, not a bf16 tensor."""
    manifest = EngineManifest(tensors={"w": TensorSpec((4, 4), torch.float8_e4m3fn)})
    with pytest.raises(ManifestError, match="dtype mismatch"):
        check_plan([_planned("w", (4, 4), torch.bfloat16)], manifest)
