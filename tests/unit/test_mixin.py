"""FSDPVLLMSyncMixin wiring with stand-in trainers: which entry point it replaces, and the DeepSpeed fallback.

The end-to-end tests run the mixin on the real TRL trainers; these cover the branches a CPU run cannot reach.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from fsdp_sync import FSDPVLLMSyncMixin


class DeepSpeedEngine(nn.Module):
    """Stands in for deepspeed's engine (recognised by class name)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)


class Generation:
    """TRL 1.x's `VLLMGeneration` surface the mixin touches."""

    mode = "colocate"
    llm = None
    enable_sleep_mode = False

    def __init__(self) -> None:
        self.builtin_calls = 0

    def sync_weights(self) -> None:
        self.builtin_calls += 1

    def generate(self, prompts: list[str]) -> list[str]:
        return [p + "!" for p in prompts]


class GenerationTrainer:
    """A GRPO-like trainer: vLLM on, sync through `vllm_generation.sync_weights`."""

    def __init__(self, model: nn.Module, use_vllm: bool = True) -> None:
        self.args = SimpleNamespace(use_vllm=use_vllm)
        self.vllm_generation = Generation()
        self.model = self.model_wrapped = model


class MoveModelTrainer:
    """An OnlineDPO-like trainer: vLLM on, sync through its own `_move_model_to_vllm`."""

    def __init__(self, model: nn.Module) -> None:
        self.args = SimpleNamespace(use_vllm=True, vllm_mode="colocate")
        self.llm = None
        self.model = self.model_wrapped = model
        self.builtin_calls = 0

    def _move_model_to_vllm(self) -> None:
        self.builtin_calls += 1


def test_generation_entry_replaced_and_deepspeed_left_to_trl() -> None:
    """The trainer's `sync_weights` becomes the mixin's; with a DeepSpeed model it calls TRL's own sync."""
    trainer = type("T", (FSDPVLLMSyncMixin, GenerationTrainer), {})(DeepSpeedEngine())
    generation = trainer.vllm_generation
    assert generation.sync_weights == trainer.sync_weights_to_vllm
    assert generation.sync_weights() is None
    assert generation.builtin_calls == 1
    assert trainer.sync_reports == []


def test_move_model_entry_overridden_and_deepspeed_left_to_trainer() -> None:
    """`_move_model_to_vllm` (OnlineDPO, older TRL) goes through the mixin; DeepSpeed reaches the trainer's method."""
    trainer = type("T", (FSDPVLLMSyncMixin, MoveModelTrainer), {})(DeepSpeedEngine())
    trainer._move_model_to_vllm()
    assert trainer.builtin_calls == 1


def test_trainer_without_vllm_is_untouched() -> None:
    """With `use_vllm=False` nothing is replaced (the trainer generates with transformers)."""
    trainer = type("T", (FSDPVLLMSyncMixin, GenerationTrainer), {})(nn.Linear(2, 2), use_vllm=False)
    assert trainer.vllm_generation.sync_weights != trainer.sync_weights_to_vllm


def test_generation_syncs_first_while_the_engine_is_stale() -> None:
    """After a failed sync TRL would generate from the stale engine (it syncs only when the step moved): the
    mixin's guard runs the trainer's sync entry first, until a sync succeeds."""
    trainer = type("T", (FSDPVLLMSyncMixin, GenerationTrainer), {})(nn.Linear(2, 2))
    generation = trainer.vllm_generation
    calls: list[str] = []
    generation.sync_weights = lambda: calls.append("sync")  # what the trainer's sync entry now is
    assert generation.generate(["a"]) == ["a!"] and calls == []
    trainer._fvs_stale = True
    assert generation.generate(["b"]) == ["b!"] and calls == ["sync"]
    assert not trainer.engine_is_current


def test_a_rank_that_writes_into_no_engine_says_so_in_its_error_and_its_report(monkeypatch) -> None:
    """Server mode: only the main process writes. Another rank's failed sync neither claims an engine state it
    cannot know ("unknown" means a server that does not answer) nor ends without saying what holds what."""
    import pytest
    import torch

    from fsdp_sync import SyncConfig, mixin
    from fsdp_sync.errors import NO_ENGINE, RankFailure, RemoteSyncError, agreed_error

    class NoEngine:
        kind = "server:gloo"
        pushes = False

    class FailingSync:
        backend, strategy, writer_kind, serves_adapter, sync_plan = "plain", "plain", "server:gloo", False, None
        writer = NoEngine()

        def sync(self) -> None:
            raise agreed_error(None, [RankFailure(0, "push", "RuntimeError: the server refused")], None)

        def resync(self) -> None:
            pass

    monkeypatch.setattr(mixin, "ColocateWriter", lambda llm, **kwargs: NoEngine())
    monkeypatch.setattr(mixin, "build_sync", lambda *args, **kwargs: FailingSync())
    trainer_cls = type("T", (FSDPVLLMSyncMixin, GenerationTrainer), {})
    trainer = trainer_cls(nn.Linear(2, 2), sync_config=SyncConfig(log_metrics=False))
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(RemoteSyncError) as failed:
        trainer.sync_weights_to_vllm()
    assert str(failed.value).endswith(f"{NO_ENGINE}."), str(failed.value)
    report = trainer.sync_reports[-1]
    assert (report.engine, report.writer, report.strategy) == ("none", "server:gloo", "plain")


def test_an_unchanged_engine_is_described_truly_at_the_first_sync_too() -> None:
    from fsdp_sync.errors import EngineState

    text = EngineState("unchanged").describe()
    assert "previous sync" not in text and "held before this sync" in text
