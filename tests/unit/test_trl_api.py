"""Unit tests for `compat.trl_api`: finding a TRL trainer's vLLM sync entry point by feature."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fsdp_sync.compat.trl_api import MOVE_MODEL_TO_VLLM, VLLM_GENERATION, TRLSyncTarget, find_sync_target, mark_weights_awake


class _SyncMixin:
    """Stands in for FSDPVLLMSyncMixin: defining `_move_model_to_vllm` to override it (passed to `find_sync_target`
    as the mixin, as the real one passes itself)."""

    def _move_model_to_vllm(self) -> None:
        raise AssertionError("not called by find_sync_target")


class _OldTRLTrainer:
    """An older TRL trainer: its own class defines `_move_model_to_vllm`."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def _move_model_to_vllm(self) -> None:
        raise AssertionError("not called by find_sync_target")


class _NewTRLTrainer:
    """A TRL >= 0.28 trainer base: no `_move_model_to_vllm`; the engine lives in `vllm_generation`."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class _MixedOld(_SyncMixin, _OldTRLTrainer):
    """The mixin in front of an older TRL trainer."""


class _MixedNew(_SyncMixin, _NewTRLTrainer):
    """The mixin in front of a trainer that has no `_move_model_to_vllm` of its own."""


def _generation(**attrs: Any) -> SimpleNamespace:
    return SimpleNamespace(sync_weights=lambda: None, **attrs)


@pytest.mark.parametrize(
    "trainer",
    [
        SimpleNamespace(args=SimpleNamespace(use_vllm=False), vllm_generation=_generation(mode="colocate")),
        SimpleNamespace(use_vllm=False, vllm_generation=_generation(mode="colocate")),
        SimpleNamespace(vllm_generation=_generation(mode="colocate")),  # no flag at all
        SimpleNamespace(args=None),
        # args.use_vllm wins over a trainer attribute
        SimpleNamespace(args=SimpleNamespace(use_vllm=False), use_vllm=True, vllm_generation=_generation(mode="x")),
    ],
)
def test_no_vllm_returns_none(trainer: SimpleNamespace) -> None:
    """A trainer whose args (or itself) do not enable vLLM has no sync target."""
    assert find_sync_target(trainer, _SyncMixin) is None


def test_vllm_generation_colocate() -> None:
    """TRL >= 0.28: `vllm_generation.sync_weights` is the entry, with its mode, llm and sleep flag."""
    llm = object()
    generation = _generation(mode="colocate", llm=llm, enable_sleep_mode=True)
    trainer = SimpleNamespace(args=SimpleNamespace(use_vllm=True), vllm_generation=generation)
    target = find_sync_target(trainer, _SyncMixin)
    assert target == TRLSyncTarget(
        entry=VLLM_GENERATION, mode="colocate", llm=llm, client=None, sleep_mode=True, owner=generation
    )
    assert target is not None and target.owner is generation


def test_vllm_generation_server() -> None:
    """Server mode: the client is taken from `vllm_generation.vllm_client`; no llm, no sleep mode by default."""
    client = object()
    generation = _generation(mode="server", vllm_client=client)
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=generation)  # flag on the trainer, no args
    target = find_sync_target(trainer, _SyncMixin)
    assert target is not None
    assert target.entry == "vllm_generation"
    assert target.mode == "server"
    assert target.client is client
    assert target.llm is None
    assert target.sleep_mode is False


def test_vllm_generation_without_callable_sync_weights_not_used() -> None:
    """A `vllm_generation` whose `sync_weights` is not callable is not an entry point."""
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=SimpleNamespace(mode="colocate", sync_weights=None))
    with pytest.raises(RuntimeError):
        find_sync_target(trainer, _SyncMixin)


def test_vllm_generation_preferred_over_move_model() -> None:
    """When both entries exist, `vllm_generation` is used."""
    generation = _generation(mode="colocate")
    trainer = _OldTRLTrainer(args=SimpleNamespace(use_vllm=True), vllm_generation=generation)
    target = find_sync_target(trainer, _SyncMixin)
    assert target is not None
    assert target.entry == VLLM_GENERATION
    assert target.owner is generation


def test_move_model_to_vllm_trainer() -> None:
    """Older TRL: a trainer class defining `_move_model_to_vllm` is the entry, with its own llm/client/mode."""
    llm, client = object(), object()
    args = SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_enable_sleep_mode=True)
    trainer = _OldTRLTrainer(args=args, vllm_mode="colocate", llm=llm, vllm_client=client)
    target = find_sync_target(trainer, _SyncMixin)
    assert target == TRLSyncTarget(
        entry=MOVE_MODEL_TO_VLLM, mode="colocate", llm=llm, client=client, sleep_mode=True, owner=trainer
    )


def test_move_model_to_vllm_mode_from_args_then_default() -> None:
    """The mode comes from `trainer.vllm_mode`, else `args.vllm_mode`, else "server"."""
    from_args = _OldTRLTrainer(args=SimpleNamespace(use_vllm=True, vllm_mode="colocate"))
    default = _OldTRLTrainer(args=SimpleNamespace(use_vllm=True))
    target_args = find_sync_target(from_args, _SyncMixin)
    target_default = find_sync_target(default, _SyncMixin)
    assert target_args is not None and target_args.mode == "colocate"
    assert target_default is not None and target_default.mode == "server"
    assert target_default.llm is None and target_default.client is None and target_default.sleep_mode is False


def test_mixin_in_front_of_old_trainer_uses_trainer_method() -> None:
    """With the mixin first in the bases, the trainer base's own `_move_model_to_vllm` is found."""
    trainer = _MixedOld(args=SimpleNamespace(use_vllm=True, vllm_mode="server"))
    target = find_sync_target(trainer, _SyncMixin)
    assert target is not None
    assert target.entry == MOVE_MODEL_TO_VLLM
    assert target.owner is trainer


def test_mixin_only_move_model_raises() -> None:
    """`_move_model_to_vllm` inherited only from the mixin, and no `vllm_generation`, is unsupported."""
    trainer = _MixedNew(args=SimpleNamespace(use_vllm=True))
    assert hasattr(trainer, MOVE_MODEL_TO_VLLM)  # present, but only from the mixin
    with pytest.raises(RuntimeError, match="_MixedNew uses vLLM but has neither") as info:
        find_sync_target(trainer, _SyncMixin)
    assert "not supported by FSDPVLLMSyncMixin" in str(info.value)


def test_instance_attribute_move_model_not_an_entry() -> None:
    """A `_move_model_to_vllm` set on the instance (not the class) does not count as a trainer method."""
    trainer = SimpleNamespace(use_vllm=True, _move_model_to_vllm=lambda: None)
    with pytest.raises(RuntimeError, match="SimpleNamespace uses vLLM"):
        find_sync_target(trainer, _SyncMixin)


def _target(owner: Any) -> TRLSyncTarget:
    return TRLSyncTarget(entry=VLLM_GENERATION, mode="colocate", llm=None, client=None, sleep_mode=True, owner=owner)


def test_mark_weights_awake_clears_sleeping_flag() -> None:
    """`mark_weights_awake` sets the owner's `_llm_weights_sleeping` to False."""
    owner = SimpleNamespace(_llm_weights_sleeping=True)
    mark_weights_awake(_target(owner))
    assert owner._llm_weights_sleeping is False


def test_mark_weights_awake_without_flag_adds_nothing() -> None:
    """An owner without the flag (older TRL) is left untouched."""
    owner = SimpleNamespace()
    mark_weights_awake(_target(owner))
    assert not hasattr(owner, "_llm_weights_sleeping")
