"""Weight versions (`fsdp_sync.versions`): what every push stamps, what a delta or sparse sync checks first, older
vLLM without versions, and the mixin's public `resync()`. The server side runs against `ThreadServer`
(`test_reconnect.py`); the end-to-end restarts are in `tests/e2e/test_recovery.py`."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from fsdp_sync import FSDPVLLMSyncMixin
from fsdp_sync.config import SyncConfig
from fsdp_sync.versions import CHECKPOINT_VERSION, ColocateVersions, VersionStamps

from .test_mixin import GenerationTrainer
from .test_reconnect import _served


class VersionedLLM:
    """The weight-version surface of vLLM's `LLM` (`get_weight_version`, `update_weight_version`)."""

    def __init__(self) -> None:
        self.version = CHECKPOINT_VERSION

    def get_weight_version(self) -> str:
        return self.version

    def update_weight_version(self, version: str) -> None:
        self.version = version


def test_every_stamp_is_new_and_names_its_run() -> None:
    first, second = VersionStamps(), VersionStamps()
    versions = [first.next(), first.next(), second.next()]
    assert len(set(versions)) == 3
    assert versions[0].startswith(f"fsdp-vllm-sync:{first.run}:") and first.run != second.run


def test_an_engine_whose_version_moved_says_both_versions_and_what_it_holds() -> None:
    llm = VersionedLLM()
    versions = ColocateVersions(llm)
    assert versions.replaced() is None, "nothing stamped yet: the first sync is complete anyway"
    versions.stamp("fsdp-vllm-sync:run:1")
    assert llm.version == "fsdp-vllm-sync:run:1" and versions.replaced() is None
    llm.version = CHECKPOINT_VERSION  # a new engine, started from its checkpoint
    why = versions.replaced()
    assert why is not None and "'default'" in why and "'fsdp-vllm-sync:run:1'" in why
    assert "it was restarted: it holds its checkpoint, not what this trainer sent" in why
    llm.version = "another-trainer:7"
    assert "replaced outside this trainer" in (versions.replaced() or "")


def test_an_engine_without_versions_is_said_once_and_changes_nothing(caplog) -> None:
    """An engine without `get_weight_version`: nothing is stamped or checked (the behaviour before weight versions),
    logged once."""
    with caplog.at_level("WARNING"):
        versions = ColocateVersions(object())
        versions.stamp("fsdp-vllm-sync:run:1")
        assert versions.replaced() is None
    assert caplog.text.count("keeps no weight version") == 1


def test_the_mixin_resync_makes_the_next_sync_complete(tmp_path: Path) -> None:
    """`trainer.resync()`: public, harmless before the first sync, and the next sync sends every weight whole."""
    trainer = type("T", (FSDPVLLMSyncMixin, GenerationTrainer), {})(nn.Linear(2, 2))
    trainer.resync()  # before the first sync: nothing to do
    sync, _, _ = _served(tmp_path, SyncConfig(delta=True, delta_check=False))
    trainer._fvs_sync = sync
    assert [sync.sync().complete for _ in range(2)] == [True, False]
    trainer.resync()
    assert [sync.sync().complete for _ in range(2)] == [True, False]
