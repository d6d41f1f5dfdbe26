"""TRL's async GRPO trainer under the mixin, unit level: recognising the trainer, the seams the mixin takes, the
policy version moving only after a sync that succeeded, the writer that pauses the server only for the write, and
the gloo backend's staged rounds over a real gloo group (two threads).

End to end (the real trainer, its rollout worker and a real vLLM server): tests/e2e/test_async_grpo.py.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync import FSDPVLLMSyncMixin
from fsdp_sync.compat.names import NameRules
from fsdp_sync.compat.server_api import ServerInfo
from fsdp_sync.compat.trl_api import ASYNC_SYNC_WEIGHT, find_sync_target, is_async_trainer, server_address
from fsdp_sync.compat.weight_transfer import plan_source, source_metadata, source_tensors
from fsdp_sync.errors import SyncError, UnsupportedSetupError
from fsdp_sync.server_client import ServerRequestError
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.trainers.async_grpo import AsyncGRPOSeam, MixinWeightTransfer
from tests.support.dist import free_port
from fsdp_sync.transfer import gloo, gloo_wire
from fsdp_sync.writers import server as server_writer
from fsdp_sync.writers.server import ServerPushError, ServerWriter

pytestmark = pytest.mark.unit


# --- recognising the trainer, and the seams ------------------------------------------------------------------------


def _async_grpo_trainer() -> type:
    """TRL's async trainer class (TRL 1.16's experimental package; CI's TRL 0.29 leg has none)."""
    return pytest.importorskip("trl.experimental.async_grpo", reason="this TRL has no async GRPO trainer").AsyncGRPOTrainer


def test_the_async_trainer_and_its_subclasses_are_recognised_and_no_other() -> None:
    from trl import GRPOTrainer, RLOOTrainer

    AsyncGRPOTrainer = _async_grpo_trainer()

    class Mine(FSDPVLLMSyncMixin, AsyncGRPOTrainer):
        def _sync_weight(self) -> None:  # a user's override, as the e2e job has
            super()._sync_weight()

    assert is_async_trainer(AsyncGRPOTrainer) and is_async_trainer(Mine, FSDPVLLMSyncMixin)
    assert not is_async_trainer(GRPOTrainer) and not is_async_trainer(RLOOTrainer)
    target = find_sync_target(object.__new__(Mine), FSDPVLLMSyncMixin)
    assert target is not None and target.entry == ASYNC_SYNC_WEIGHT and target.mode == "server"


def test_the_async_config_always_names_a_server() -> None:
    args = SimpleNamespace(vllm_server_base_url="http://10.0.0.5:8000/", vllm_server_timeout=30)
    assert server_address(args) is None  # no use_vllm / vllm_mode: not server mode for the other trainers
    address = server_address(args, always_server=True, group_port=51300)
    assert address is not None
    assert (address.base_url, address.startup_timeout_s, address.group_port) == ("http://10.0.0.5:8000", 30.0, 51300)


def _async_mixin_class() -> type:
    AsyncGRPOTrainer = _async_grpo_trainer()

    class Trainer(FSDPVLLMSyncMixin, AsyncGRPOTrainer):
        pass

    return Trainer


def test_a_weight_transfer_of_the_users_is_refused_before_anything_is_built() -> None:
    Trainer = _async_mixin_class()
    with pytest.raises(UnsupportedSetupError, match="owns the weight sync: drop the weight_transfer argument"):
        Trainer(model="unused", args=SimpleNamespace(), weight_transfer=object())


def test_an_async_trainer_without_args_is_refused_with_what_to_pass() -> None:
    Trainer = _async_mixin_class()
    with pytest.raises(UnsupportedSetupError, match=r"needs args=AsyncGRPOConfig\(vllm_server_base_url=...\)"):
        Trainer(model="unused")


def test_trls_own_pause_send_and_resume_are_refused_and_destroy_closes_the_transfer() -> None:
    """The `weight_transfer` the seam hands TRL's constructor: TRL's own pause/send/resume refuse (the mixin owns
    the sync), and its `destroy` runs the close it was given."""
    closed: list[int] = []
    kwargs = AsyncGRPOSeam("Trainer").constructor_kwargs({"args": object()}, {"seed": 1}, lambda: closed.append(1))
    transfer = kwargs["weight_transfer"]
    assert isinstance(transfer, MixinWeightTransfer) and kwargs["seed"] == 1
    transfer.init_weight_transfer()  # nothing: set up at the first sync
    for call in (transfer.pause, transfer.resume, lambda: transfer.send_weights(iter(()))):
        with pytest.raises(RuntimeError, match=r"Call `trainer._sync_weight\(\)`"):
            call()
    transfer.destroy()
    assert closed == [1]


class _AsyncTrainer:
    """The async trainer's public surface the seam uses: `model_version`, the rollout worker (main process), and
    `Trainer.log` (where metrics go for a trainer without GRPO's metric buckets)."""

    def __init__(self) -> None:
        self.model_version = 3
        self.told: list[int] = []
        self.rollout_worker = SimpleNamespace(update_model_version=self.told.append)
        self.logged: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float]) -> None:
        self.logged.append(metrics)


def test_the_policy_version_moves_after_a_sync_that_succeeded() -> None:
    trainer = _AsyncTrainer()
    AsyncGRPOSeam("Trainer").sync(trainer, lambda: None, lambda: (0.25, 0.125))
    assert trainer.model_version == 4 and trainer.told == [4]
    [metrics] = trainer.logged
    assert metrics["weight_sync/server_paused_s"] == 0.25 and metrics["weight_sync/server_write_s"] == 0.125
    assert metrics["perf/weight_sync_s"] >= 0


def test_a_failed_sync_leaves_the_policy_version_and_the_rollout_worker_alone() -> None:
    trainer = _AsyncTrainer()

    def failing() -> None:
        raise SyncError("the weight sync failed on rank 1 (gather)")

    with pytest.raises(SyncError, match="rank 1"):
        AsyncGRPOSeam("Trainer").sync(trainer, failing, lambda: None)
    assert trainer.model_version == 3 and trainer.told == [] and trainer.logged == []


def test_the_writer_labels_versions_with_the_next_policy_version_and_pauses_only_the_write() -> None:
    trainer = _AsyncTrainer()
    options = AsyncGRPOSeam("Trainer").writer_options(trainer)
    assert options.pause_for_write and options.version_label is not None
    assert options.version_label() == "v4"
    trainer.model_version = 9
    assert options.version_label() == "v10"


# --- the writer: paused only for the write ------------------------------------------------------------------------


class StagingEngine:
    """Stands in for the gloo trainer engine: records sends and the commit, in the order the writer calls them."""

    calls: list[str] = []
    fail_commit: Exception | None = None

    class init_info_cls:  # noqa: N801 - mirrors vLLM's attribute name
        def __init__(self, **fields: Any) -> None:
            self.fields = fields

    def __init__(self, source: Any) -> None:
        self.source = source
        self.staged = False
        self.pending = False  # staged rounds sent, not committed (`StagedTransfer.pending`)
        self.data_chunks = 0

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any) -> StagingEngine:
        return cls(source)

    def bound(self, deadline: float | None) -> None:
        """Nothing to bound."""

    def shutdown(self) -> None:
        StagingEngine.calls.append("shutdown")

    def abandon(self) -> None:
        self.pending = False

    def send_weights(self) -> None:
        list(source_tensors(self.source))
        StagingEngine.calls.append("send(staged)" if self.staged else "send")
        self.pending = self.staged

    def commit(self) -> None:
        StagingEngine.calls.append("commit")
        self.data_chunks = 1
        if StagingEngine.fail_commit is not None:
            raise StagingEngine.fail_commit
        self.pending = False


class PausingClient:
    base_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.version = "default"
        self.fail_resume: Exception | None = None

    def world_size(self) -> int:
        return 1

    def pause(self) -> None:
        StagingEngine.calls.append("pause")

    def resume(self) -> None:
        StagingEngine.calls.append("resume")
        if self.fail_resume is not None:
            raise self.fail_resume

    def reset_prefix_cache(self) -> None:
        StagingEngine.calls.append("reset")

    def finish_weight_update(self) -> None:
        StagingEngine.calls.append("finish")

    def weight_version(self, timeout: float | None = None) -> str:
        return self.version

    def update_weight_version(self, version: str) -> None:
        self.version = version


class OneTensor:
    strategy = "fake"
    tensors_outlive_step = True

    def __init__(self) -> None:
        self.value = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    def specs(self) -> dict[str, Any]:
        from fsdp_sync.compat.manifest import TensorSpec

        return {"w.weight": TensorSpec((2, 3), torch.float32)}

    def iter_full(self, meter: object, select: Any = None, rounds: object = None) -> Any:
        yield "w.weight", self.value

    def trainable(self) -> frozenset[str]:
        return frozenset({"w.weight"})


def _pausing_sync(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backend: str) -> tuple[WeightSync, PausingClient]:
    StagingEngine.calls, StagingEngine.fail_commit = [], None
    monkeypatch.setattr(server_writer, "trainer_transfer_engine", lambda name: StagingEngine)
    monkeypatch.setattr(server_writer.torch.cuda, "is_available", lambda: True)  # lets the nccl transport be chosen
    save_file({"w.weight": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    client = PausingClient()
    info = ServerInfo(model="/srv/m", dtype=torch.bfloat16, weight_transfer_backend=backend, served_name="m")
    version = {"next": 7}
    writer = ServerWriter(
        client, info, group_port=12345, checkpoint_dir=str(tmp_path), buffer_bytes=1024, timeout_s=5,  # type: ignore[arg-type]
        pause_for_write=True, version_label=lambda: f"v{version['next']}",
    )  # fmt: skip
    return WeightSync(OneTensor(), writer, rules=NameRules()), client


def test_a_staging_transport_sends_unpaused_and_pauses_only_for_the_write(monkeypatch, tmp_path: Path) -> None:
    sync, client = _pausing_sync(monkeypatch, tmp_path, "gloo")
    sync.sync()
    assert StagingEngine.calls == ["send(staged)", "pause", "commit", "reset", "resume"]
    assert client.version.endswith(":v7")
    paused, write = sync.writer.last_pause  # type: ignore[attr-defined]
    assert 0 <= write <= paused


def test_nccl_cannot_stage_so_the_pause_covers_the_send(monkeypatch, tmp_path: Path) -> None:
    sync, _ = _pausing_sync(monkeypatch, tmp_path, "nccl")
    sync.sync()
    # The prefix cache is reset inside the pause: a request resumed before it could reuse blocks of the old weights.
    assert StagingEngine.calls == ["pause", "send", "reset", "resume"]


def test_a_write_that_fails_under_the_pause_still_resumes_the_server(monkeypatch, tmp_path: Path) -> None:
    sync, client = _pausing_sync(monkeypatch, tmp_path, "gloo")
    StagingEngine.fail_commit = ServerRequestError("HTTP 500: the reload failed at model.layers.0 (part-way)")
    with pytest.raises(ServerPushError, match="failed to write the staged weights") as failed:
        sync.sync()
    assert StagingEngine.calls[:4] == ["send(staged)", "pause", "commit", "resume"]
    assert failed.value.engine is not None and failed.value.engine.status == "mixed"
    assert sync.writer.last_pause is not None, "the server was paused: the pause is timed"  # type: ignore[attr-defined]
    assert client.version == "default"  # nothing stamped
    StagingEngine.fail_commit = None
    StagingEngine.calls = []
    sync.sync()  # the next one connects again, complete
    assert StagingEngine.calls == ["send(staged)", "pause", "commit", "reset", "resume"]


# --- the gloo backend's staged rounds, over a real group ----------------------------------------------------------


def _update(tensors: dict[str, torch.Tensor], **fields: Any) -> gloo.GlooUpdateInfo:
    meta = source_metadata(_source(tensors))
    return gloo.GlooUpdateInfo(
        names=[m.name for m in meta],
        dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
        shapes=[list(m.shape) for m in meta],
        **fields,
    )


def _source(tensors: dict[str, torch.Tensor]) -> Any:
    source = plan_source((n, t.dtype, t.shape) for n, t in tensors.items())
    source.feed(tensors.items())
    return source


class _Pair:
    """A worker engine and a trainer engine joined over a real gloo group on 127.0.0.1; the worker's writes are
    recorded (the model's loader is vLLM's, not run here)."""

    def __init__(self) -> None:
        port = free_port()
        self.host = gloo_wire.listen("127.0.0.1", port, 2, timeout_s=30)
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
        )
        self.worker = gloo.GlooWeightTransferEngine(None, config, torch.device("cpu"), SimpleNamespace())  # type: ignore[arg-type]
        self.worker.buffer_bytes = 256
        self.written: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
        self.worker._dense.receive = self._dense  # type: ignore[method-assign]
        self.worker._dense.finish = lambda: self.written.append(("finish", []))  # type: ignore[method-assign]
        joined: Future = Future()
        threading.Thread(
            target=lambda: joined.set_result(gloo_wire.open_group("127.0.0.1", port, 1, 2, timeout_s=30)), daemon=True
        ).start()
        self.trainer = gloo.GlooTrainerWeightTransferEngine(client=None, source=None, buffer_bytes=256, timeout_s=30)  # type: ignore[arg-type]
        self.trainer.group = gloo_wire.open_group("127.0.0.1", port, 0, 2, timeout_s=30)
        self.worker.group = joined.result(timeout=30)

    def _dense(self, info: gloo.GlooUpdateInfo, received: Any = None) -> None:
        sizes = [t.itemsize * int(torch.Size(s).numel()) for t, s in zip(info.dtypes(), info.shapes)]
        weights = []
        for chunk, buffer in received:
            for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                flat = buffer[offset : offset + sizes[i]].view(info.dtypes()[i])
                weights.append((info.names[i], flat.view(info.shapes[i]).clone()))
        self.written.append(("dense", weights))

    def send(self, tensors: dict[str, torch.Tensor], fail_after: int | None = None) -> None:
        meta = source_metadata(_source(tensors))
        stream = list(tensors.items())
        if fail_after is not None:

            def failing():
                yield from stream[:fail_after]
                raise RuntimeError("the trainer's gather failed")

            self.trainer._broadcast_stream(failing(), meta, Future())
        else:
            self.trainer._broadcast_stream(stream, meta, Future())


def test_staged_rounds_return_at_once_and_reach_the_engine_only_at_apply() -> None:
    g = torch.Generator().manual_seed(0)
    first = {"a.weight": torch.randn(9, 7, generator=g).bfloat16(), "b.bias": torch.randn(5, generator=g)}
    second = {"c.weight": torch.randn(30, 3, generator=g)}  # larger than the buffer: travels alone
    pair = _Pair()
    pair.worker.update_weights(vars(_update(first, stage="receive")))  # returns before any chunk was sent
    pair.worker.update_weights(vars(_update(second, stage="receive")))
    assert pair.written == []
    pair.trainer.staged = True
    pair.send(first)
    pair.send(second)
    assert pair.written == [] and pair.trainer.data_chunks == 0  # received, not written
    pair.worker.update_weights(vars(gloo.GlooUpdateInfo(names=[], dtype_names=[], shapes=[], stage="apply")))
    assert [kind for kind, _ in pair.written] == ["dense", "finish", "dense", "finish"]
    got = [item for _, weights in pair.written for item in weights]
    want = [*first.items(), *second.items()]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_staged_round_the_trainer_aborts_writes_nothing() -> None:
    tensors = {f"t{i}.weight": torch.full((16, 4), float(i)) for i in range(6)}  # 256 bytes each: one per chunk
    pair = _Pair()
    pair.trainer.staged = True
    pair.worker.update_weights(vars(_update(tensors, stage="receive")))
    with pytest.raises(RuntimeError, match="gather failed"):
        pair.send(tensors, fail_after=3)
    with pytest.raises(RuntimeError, match="did not arrive whole.*nothing was written") as failed:
        pair.worker.update_weights(vars(gloo.GlooUpdateInfo(names=[], dtype_names=[], shapes=[], stage="apply")))
    assert isinstance(failed.value.__cause__, gloo.UpdateAborted)
    assert pair.written == []


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stage='later'; valid: None, 'receive', 'apply'"):
        gloo.GlooUpdateInfo(names=[], dtype_names=[], shapes=[], stage="later")


# --- the reload fixes in every weight-transfer engine of a server with this package --------------------------------


def test_every_engine_the_factory_makes_applies_the_reload_fixes_before_its_update(monkeypatch) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.worker_base import WorkerBase

    from fsdp_sync.compat import vllm_patches
    from fsdp_sync.transfer import questions

    calls: list[str] = []

    class Engine:
        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            self.model = model

        def start_weight_update(self) -> None:
            calls.append("vllm's start")

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(vllm_patches, "keep_moe_experts_processed_on_reload", lambda m: calls.append("moe") or [])
    monkeypatch.setattr(vllm_patches, "load_gpt_oss_through_weight_loaders", lambda m: calls.append("gpt-oss") or ["m"])
    monkeypatch.setitem(WeightTransferEngineFactory._registry, "fvs-test", lambda: Engine)
    assert vllm_patches.fix_every_weight_transfer_engine() and vllm_patches.fix_every_weight_transfer_engine()
    engine = WeightTransferEngineFactory.create_engine(SimpleNamespace(backend="fvs-test"), None, "cpu", model)
    engine.start_weight_update()
    assert calls == ["moe", "gpt-oss", "vllm's start"]
    questions.install()
    answer = getattr(WorkerBase, questions.ASK_METHOD)(None, "engine_fixes", [], questions.Route.FIRST_REPLICA.value)
    assert answer["answer"] == list(vllm_patches.ENGINE_FIXES)


def _gpt_oss_checkpoint(tmp_path: Path) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"]}))
    save_file(
        {"model.layers.0.self_attn.sinks": torch.zeros(2), "model.norm.weight": torch.zeros(4)},
        str(tmp_path / "model.safetensors"),
    )
    return str(tmp_path)


@pytest.mark.parametrize("fixed", [False, True])
def test_gpt_oss_over_nccl_is_refused_only_where_the_server_lacks_the_fix(monkeypatch, tmp_path: Path, fixed) -> None:
    monkeypatch.setattr(server_writer.torch.cuda, "is_available", lambda: True)
    fixes = frozenset({"load_gpt_oss_through_weight_loaders"}) if fixed else frozenset()
    info = ServerInfo(model="/srv/m", dtype=torch.bfloat16, weight_transfer_backend="nccl", served_name="m",
                      engine_fixes=fixes)  # fmt: skip
    writer = ServerWriter(None, info, group_port=1, checkpoint_dir=_gpt_oss_checkpoint(tmp_path), buffer_bytes=1,
                          timeout_s=1)  # fmt: skip
    refused = writer.manifest().refused
    if fixed:
        assert not refused
    else:
        assert set(refused) == {"model.layers.0.self_attn.sinks"}
        assert "install fsdp-vllm-sync in the server's environment" in refused["model.layers.0.self_attn.sinks"]


def test_the_async_trainer_merges_by_default_and_pushes_adapters_when_asked() -> None:
    from fsdp_sync import SyncConfig

    seam = AsyncGRPOSeam("Trainer")
    assert seam.sync_config(SyncConfig()).adapter is False
    assert seam.sync_config(SyncConfig(adapter=True)).adapter is True


def test_adapter_syncs_need_a_server_keeping_every_version_a_rollout_in_flight_may_name() -> None:
    """`max_staleness=4`: rollouts up to 4 versions old are trained on, so the server must keep the last 5 adapter
    versions servable; fewer is refused at the build, naming the setting; a rank that does not ask the server
    (None) refuses nothing."""
    seam = AsyncGRPOSeam("Trainer")
    trainer = SimpleNamespace(args=SimpleNamespace(max_staleness=4))
    refusal = seam.adapter_refusal(trainer, lambda: 2)
    assert refusal is not None and "keeps 2 adapter version(s)" in refusal
    assert "FSDP_VLLM_SYNC_ADAPTER_VERSIONS=5" in refusal and "--max-cpu-loras 5" in refusal
    assert seam.adapter_refusal(trainer, lambda: 5) is None
    assert seam.adapter_refusal(trainer, None) is None


def test_the_rollout_worker_is_made_to_ask_for_each_adapter_version_by_name() -> None:
    """TRL 1.16's worker (built as `AsyncGRPOTrainer` builds it with a `weight_transfer`: `lora_name=None`) asks,
    once named, for `<prefix>-v<model_version>`: the name the adapter sync gives version N. A worker that started
    already, or keeps no `lora_name`, is refused with the reason."""
    worker_module = pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker")  # TRL >= 1.x
    AsyncRolloutWorker, _AsyncRolloutLoop = worker_module.AsyncRolloutWorker, worker_module._AsyncRolloutLoop

    from fsdp_sync.compat.trl_adapter import name_rollout_requests

    worker = AsyncRolloutWorker(model_name="m", lora_name=None)
    name_rollout_requests(worker, "fsdp-vllm-sync")
    assert worker._loop_kwargs["lora_name"] == "fsdp-vllm-sync"
    loop = SimpleNamespace(lora_name=worker._loop_kwargs["lora_name"], model_version=3, model_name="m")
    assert _AsyncRolloutLoop._request_model.fget(loop) == "fsdp-vllm-sync-v3"
    assert AsyncGRPOSeam("Trainer").serve_adapter(SimpleNamespace(rollout_worker=worker), "p") is True
    assert worker._loop_kwargs["lora_name"] == "p"
    worker._process = object()
    with pytest.raises(RuntimeError, match="started already"):
        name_rollout_requests(worker, "p")
    with pytest.raises(RuntimeError, match="keeps no `lora_name`.*adapter=False"):
        name_rollout_requests(SimpleNamespace(_loop_kwargs={}), "p")


def test_a_failed_verify_moves_no_version(monkeypatch, tmp_path: Path) -> None:
    """Versions are published last: a push written on the server but failed by `verify` (its digests differ from
    what was sent) leaves the server's weight version where it was, and the next good sync moves it."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.errors import VerifyError

    sync, client = _pausing_sync(monkeypatch, tmp_path, "gloo")
    sync = WeightSync(OneTensor(), sync.writer, SyncConfig(delta=False, verify=True), rules=NameRules())
    sent = OneTensor().value.to(torch.bfloat16)
    digest = __import__("hashlib").sha256(sent.contiguous().view(torch.uint8).numpy().data).hexdigest()
    client.checksums = {"dp0:pp0:pcp0:tp0:w.weight": "0" * 64}
    client.weight_checksums = lambda: dict(client.checksums)  # type: ignore[attr-defined]
    with pytest.raises(VerifyError, match="w.weight") as failed:
        sync.sync()
    assert "commit" in StagingEngine.calls  # the weights were written
    assert client.version == "default", "a failed verify moved the server's weight version"
    engine = failed.value.engine
    assert engine is not None and str(failed.value).endswith(f"This rank's engine {engine.describe()}.")
    client.checksums = {"dp0:pp0:pcp0:tp0:w.weight": digest}
    sync.sync()
    assert client.version.startswith("fsdp-vllm-sync:") and client.version.endswith(":v7")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_resume_that_fails_after_a_failed_write_keeps_the_writes_error(monkeypatch, tmp_path: Path, backend) -> None:
    """The write's error is the one raised (the resume's is logged beside it), on both transports."""
    sync, client = _pausing_sync(monkeypatch, tmp_path, backend)
    client.fail_resume = ServerRequestError("HTTP 500: resume refused")
    if backend == "gloo":
        StagingEngine.fail_commit = ServerRequestError("HTTP 500: a staged update did not arrive whole")
    else:
        def refuse_reset() -> None:
            raise ServerRequestError("HTTP 500: reset refused")

        client.reset_prefix_cache = refuse_reset  # type: ignore[method-assign]
    with pytest.raises(SyncError) as failed:
        sync.sync()
    text = str(failed.value)
    assert ("did not arrive whole" if backend == "gloo" else "reset refused") in text, text
    assert "resume refused" not in text, text
    assert sync.writer.last_pause is not None  # type: ignore[attr-defined]
    assert client.version == "default"


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_resume_that_fails_after_a_good_write_is_reported_as_such(monkeypatch, tmp_path: Path, backend) -> None:
    """Not as a failed write: the weights are in (the engine holds every weight of the sync), the server stays
    paused, and the version does not move (the sync failed)."""
    from fsdp_sync.writers.server import ServerResumeError

    sync, client = _pausing_sync(monkeypatch, tmp_path, backend)
    client.fail_resume = ServerRequestError("HTTP 500: resume refused")
    with pytest.raises(ServerResumeError, match="written, but the vLLM server could not be resumed") as failed:
        sync.sync()
    assert "failed to write" not in str(failed.value)
    assert failed.value.engine is not None and failed.value.engine.status == "current"
    assert str(failed.value).endswith(f"This rank's engine {failed.value.engine.describe()}.")
    assert sync.writer.last_pause is not None  # type: ignore[attr-defined]
    assert client.version == "default"


def test_a_stamp_that_fails_is_agreed_and_says_the_weights_are_in_under_the_old_version(monkeypatch, tmp_path) -> None:
    """The publish step's own failure: raised on every rank (stage `publish`), the engine holding this sync's weights
    under its previous version; the next sync is complete and stamps again."""
    sync, client = _pausing_sync(monkeypatch, tmp_path, "gloo")

    def refuse(version: str) -> None:
        raise ServerRequestError("HTTP 500: update_weight_version refused")

    client.update_weight_version = refuse  # type: ignore[method-assign]
    with pytest.raises(SyncError, match=r"rank 0 \(publish\)") as failed:
        sync.sync()
    assert failed.value.engine is not None and failed.value.engine.status == "current"
    assert "its weight version was not moved" in str(failed.value) and client.version == "default"
    del client.update_weight_version
    assert sync.sync().complete and client.version.endswith(":v7")
