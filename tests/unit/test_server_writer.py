"""Server mode, unit level: the transport choice, `ServerWriter` with a recording trainer engine, the gloo backend's
chunking and a real gloo round trip between two threads, the server-info parser and TRL's server settings.

The end-to-end tests against a real vLLM server process are in `tests/e2e/test_server_mode.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.compat.manifest import TensorSpec
from fsdp_sync.compat.names import NameRules
from fsdp_sync.compat.server_api import ServerInfo, parse_server_info
from fsdp_sync.compat.trl_api import defer_trl_weight_communicator, server_address
from fsdp_sync.compat.weight_transfer import plan_source, source_metadata, source_tensors
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.sync.verify import EMPTY_DIGEST
from fsdp_sync.server_client import ServerConfigError, ServerRequestError
from tests.support.dist import free_port
from fsdp_sync.transfer import gloo, gloo_trainer, gloo_wire, questions
from fsdp_sync.writers import server as server_writer
from fsdp_sync.writers.server import ServerPushError, ServerTransportError, ServerWriter, transport_for


def _info(backend: str | None = "gloo") -> ServerInfo:
    return ServerInfo(model="/srv/model", dtype=torch.bfloat16, weight_transfer_backend=backend, served_name="m")


# --- the transport, decided once from the server's configuration -------------------------------------------------


def test_no_backend_says_how_to_restart_the_server() -> None:
    with pytest.raises(ServerConfigError, match="without a weight-transfer backend") as err:
        transport_for(_info(None))
    assert '"gloo"' in str(err.value) and '"nccl"' in str(err.value)


def test_unsupported_backend_names_the_supported_ones() -> None:
    with pytest.raises(ServerConfigError, match=r"'ipc'.*\['nccl', 'gloo'\]"):
        transport_for(_info("ipc"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_without_cuda_points_to_gloo() -> None:
    with pytest.raises(ServerConfigError, match="needs CUDA on the trainer"):
        transport_for(_info("nccl"))


# --- ServerWriter through the pipeline, with a recording trainer engine -----------------------------------------


class RecordingEngine:
    """Stands in for a vLLM trainer engine: reads the source as vLLM's engines do (metadata, then one pass)."""

    instances: list[RecordingEngine] = []
    fail_next: Exception | None = None

    class init_info_cls:  # noqa: N801 - mirrors vLLM's attribute name
        def __init__(self, **fields: Any) -> None:
            self.fields = fields

    def __init__(self, init_info: Any, source: Any) -> None:
        self.init_info = init_info
        self.source = source
        self.rounds: list[tuple[list[Any], list[tuple[str, torch.Tensor]]]] = []
        self.deadlines: list[float | None] = []

    def bound(self, deadline: float | None) -> None:
        self.deadlines.append(deadline)

    def shutdown(self) -> None:
        """Nothing to close."""

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any) -> RecordingEngine:
        engine = cls(init_info, source)
        cls.instances.append(engine)
        return engine

    def send_weights(self) -> None:
        meta = source_metadata(self.source)
        sent = []
        for name, tensor in source_tensors(self.source):
            if RecordingEngine.fail_next is not None:
                error, RecordingEngine.fail_next = RecordingEngine.fail_next, None
                raise error
            sent.append((name, tensor.clone()))
        self.rounds.append((meta, sent))


class FakeClient:
    base_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.resets = 0
        self.finishes = 0
        self.version = "default"

    def world_size(self) -> int:
        return 1

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def finish_weight_update(self) -> None:
        self.finishes += 1
        raise ServerRequestError("finish_weight_update called without a matching start_weight_update")

    def weight_version(self, timeout: float | None = None) -> str:
        return self.version

    def update_weight_version(self, version: str) -> None:
        self.version = version


class TwoTensorGatherer:
    """Yields a float and an integer tensor under wrapper names, in a fixed order."""

    strategy = "fake"
    tensors_outlive_step = True

    def __init__(self) -> None:
        self.values = {
            "_fsdp_wrapped_module.b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "_fsdp_wrapped_module.a.index": torch.arange(4, dtype=torch.int64),
        }

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.values.items()}

    def iter_full(
        self, meter: object, select: frozenset[str] | None = None, rounds: object = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, t) for n, t in self.values.items() if select is None or n in select)

    def trainable(self) -> frozenset[str]:
        return frozenset(self.values)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    RecordingEngine.instances = []
    RecordingEngine.fail_next = None
    monkeypatch.setattr(server_writer, "trainer_transfer_engine", lambda backend: RecordingEngine)
    save_file(
        {"b.weight": torch.zeros(2, 3, dtype=torch.bfloat16), "a.index": torch.zeros(4, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    client = FakeClient()
    writer = ServerWriter(client, _info(), group_port=12345, checkpoint_dir=str(tmp_path), buffer_bytes=1024, timeout_s=5)  # type: ignore[arg-type]
    return WeightSync(TwoTensorGatherer(), writer, rules=NameRules()), client


def test_metadata_from_the_plan_in_stream_order_and_engine_dtype(recording) -> None:
    sync, client = recording
    sync.sync()
    (engine,) = RecordingEngine.instances
    meta, sent = engine.rounds[0]
    assert [(m.name, m.dtype, m.shape) for m in meta] == [
        ("b.weight", torch.bfloat16, (2, 3)),
        ("a.index", torch.int64, (4,)),
    ]
    assert [n for n, _ in sent] == ["b.weight", "a.index"]
    assert sent[0][1].dtype == torch.bfloat16 and torch.equal(sent[0][1], torch.arange(6.0).reshape(2, 3).bfloat16())
    assert torch.equal(sent[1][1], torch.arange(4))
    deadline = engine.init_info.fields.pop("deadline")
    assert engine.init_info.fields == {
        "master_address": "127.0.0.1",
        "master_port": 12345,
        "world_size": 2,
        "buffer_bytes": 1024,
        "timeout_s": 5,
        "rank": 0,
    }
    assert isinstance(deadline, float), "the handshake is bounded by the sync's deadline"
    assert client.resets == 1


def test_handshake_once_then_every_sync_reuses_it(recording) -> None:
    sync, _ = recording
    sync.sync()
    sync.sync()
    (engine,) = RecordingEngine.instances
    assert len(engine.rounds) == 2


def test_transport_failure_is_reported_as_such_and_the_next_sync_reconnects(recording) -> None:
    sync, client = recording
    sync.sync()
    RecordingEngine.fail_next = RuntimeError("Connection reset by peer")
    with pytest.raises(ServerTransportError, match="Connection reset by peer") as err:
        sync.sync()
    assert err.value.engine is not None and err.value.engine.status == "mixed"
    assert "mix of previous and new weights, none undefined" in str(err.value)
    assert "rank 0 (push): ServerTransportError" in str(err.value)
    assert client.resets == 1, "no prefix-cache reset after a failed push"
    sync.sync()
    assert len(RecordingEngine.instances) == 2, "a failed transfer is set up again"
    assert client.finishes == 1, "the update session a failed round may have left open is closed first"


def test_server_error_answer_is_a_push_error(recording) -> None:
    sync, _ = recording
    RecordingEngine.fail_next = ServerRequestError("HTTP 500: Invalid update_info")
    with pytest.raises(ServerPushError, match="Invalid update_info"):
        sync.sync()


def test_a_failure_of_the_stream_itself_is_not_called_a_transport_failure(recording) -> None:
    """An error raised by the gather or the name mapping inside the stream reaches the caller as it is."""
    sync, _ = recording
    sync.sync()
    sync.gatherer.values["_fsdp_wrapped_module.c.new"] = torch.zeros(1)  # the model grew after the plan was made
    from fsdp_sync.sync.stream import IncompleteSyncError

    with pytest.raises(IncompleteSyncError, match="c.new"):
        sync.sync()


def test_non_sending_rank_only_drains() -> None:
    writer = ServerWriter(None, _info(), group_port=1, buffer_bytes=1024, timeout_s=5)
    assert not writer.pushes and writer.engine_dtype == torch.bfloat16


# --- the gloo backend ---------------------------------------------------------------------------------------------


def test_plan_chunks_packs_aligned_and_keeps_large_tensors_alone() -> None:
    chunks = gloo.plan_chunks([10, 10, 200, 30, 0, 5], buffer_bytes=128)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 3), (3, 6)]
    assert chunks[0].offsets == (0, 64) and chunks[0].nbytes == 74
    assert chunks[1].offsets == (0,) and chunks[1].nbytes == 200
    assert chunks[2].offsets == (0, 64, 64) and chunks[2].nbytes == 69
    assert all(o % 64 == 0 for c in chunks for o in c.offsets)
    with pytest.raises(ValueError, match="buffer_bytes"):
        gloo.plan_chunks([1], buffer_bytes=0)


def _source(tensors: dict[str, torch.Tensor]) -> Any:
    """A `WeightSource` of the installed vLLM announcing `tensors` and yielding them once."""
    source = plan_source((n, t.dtype, t.shape) for n, t in tensors.items())
    source.feed(tensors.items())
    return source


def test_gloo_round_trip_is_bit_exact_over_a_real_group() -> None:
    """The trainer's packing and the worker's unpacking over a real gloo group on 127.0.0.1 (two threads): every
    tensor arrives bit for bit, in order, in its dtype and shape, in chunks no larger than the buffer (or one tensor)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g).bfloat16(),
        "b.bias": torch.randn(3, generator=g),
        "c.index": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "d.mask": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.big": torch.randn(40, 40, generator=g),  # 6400 bytes: larger than the buffer, travels alone
    }
    port = free_port()
    host = gloo_wire.listen("127.0.0.1", port, 2, timeout_s=30)
    loaded: list[list[tuple[str, torch.Tensor]]] = []
    model = SimpleNamespace(load_weights=lambda weights: loaded.append([(n, t.clone()) for n, t in weights]))
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    worker = gloo.GlooWeightTransferEngine(None, config, torch.device("cpu"), model)  # type: ignore[arg-type]
    worker.buffer_bytes = 512
    meta = source_metadata(_source(tensors))
    update = gloo.GlooUpdateInfo(
        names=[m.name for m in meta],
        dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
        shapes=[list(m.shape) for m in meta],
    )
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            worker.group = gloo_wire.open_group("127.0.0.1", port, 1, 2, timeout_s=30)
            worker.receive_weights(update)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    trainer = gloo.GlooTrainerWeightTransferEngine(client=None, source=_source(tensors), buffer_bytes=512, timeout_s=30)  # type: ignore[arg-type]
    trainer.group = gloo_wire.open_group("127.0.0.1", port, 0, 2, timeout_s=30)
    from concurrent.futures import Future

    trainer._broadcast_stream(source_tensors(_source(tensors)), meta, Future())
    thread.join(timeout=60)
    del host
    assert not errors, errors
    received = [item for chunk in loaded for item in chunk]
    assert [n for n, _ in received] == list(tensors)
    for (name, got), want in zip(received, tensors.values()):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert len(loaded) == len(gloo.plan_chunks([t.numel() * t.element_size() for t in tensors.values()], 512))


class _AnsweringServer:
    """A stand-in for `/collective_rpc` only: runs `questions.answer` (the method `questions.install` gives vLLM's
    workers) on each of its workers (each a real gloo rank of the transfer group, on a thread of its own, as vLLM
    runs the method on every worker of every replica) and answers with the first worker's result only, as vLLM does
    for a data-parallel server."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def collective_rpc(self, method: str, args: list[Any]) -> list[Any]:
        assert method == questions.ASK_METHOD
        results: list[Any] = [None] * len(self.workers)

        def run(i: int) -> None:
            results[i] = questions.answer(self.workers[i], *args)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results[:1]


def test_every_worker_answers_over_the_transfer_group_even_where_the_route_answers_for_one(monkeypatch) -> None:
    """`questions.ask`, a question answered over the group: each worker's answer (of a different length, tagged
    with its `/weight_checker` prefix) reaches the trainer over a real gloo group, in transfer-rank order, though the
    route itself answers for the first worker only; a question one worker cannot answer fails, naming that worker
    and its error, without waiting for the group's timeout."""
    port = free_port()
    host = gloo_wire.listen("127.0.0.1", port, 3, timeout_s=30)
    tags = ["dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"]
    workers: list[Any] = []
    for tag in tags:
        engine = SimpleNamespace(group=None, timeout_s=30)
        workers.append(SimpleNamespace(weight_transfer_engine=engine, _weight_checksum_prefix=lambda t=tag: t + ":"))
    opened = [threading.Thread(target=lambda i=i: setattr(workers[i].weight_transfer_engine, "group",
                                                          gloo_wire.open_group("127.0.0.1", port, i + 1, 3, 30)))
              for i in range(2)]  # fmt: skip
    for t in opened:
        t.start()
    trainer = gloo.GlooTrainerWeightTransferEngine(client=None, source=None, timeout_s=30)  # type: ignore[arg-type]
    trainer.group = gloo_wire.open_group("127.0.0.1", port, 0, 3, timeout_s=30)
    for t in opened:
        t.join(timeout=60)
    server = _AnsweringServer(workers)

    def declare(answers: Any) -> None:
        where = questions.Question("where", (int,), list[str], answers, questions.Route.EVERY_REPLICA)
        monkeypatch.setitem(questions.QUESTIONS, "where", where)

    declare(lambda worker, n: [worker._weight_checksum_prefix()] * n)
    answers = questions.ask(server, "where", 2, transfer=trainer)
    assert answers == [{"worker": t, "answer": [t + ":"] * 2} for t in tags]
    declare(lambda worker, n: 1 / (worker is workers[0]))
    with pytest.raises(RuntimeError, match=r"could not answer where: dp1:pp0:pcp0:tp0: ZeroDivisionError"):
        questions.ask(server, "where", 0, transfer=trainer)
    del host


def test_stream_that_disagrees_with_the_announcement_names_the_tensor() -> None:
    tensors = {"a.weight": torch.zeros(2, 2)}
    meta = source_metadata(_source(tensors))
    wrong = {"a.weight": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"expected 'a.weight' torch.float32 \(2, 2\), got 'a.weight' torch.float32 \(2, 3\)"):
        list(gloo_trainer.checked(wrong.items(), meta))
    with pytest.raises(ValueError, match="ended before 'a.weight'"):
        list(gloo_trainer.checked({}.items(), meta))


# --- what the server and the trainer's config say ----------------------------------------------------------------


def test_parse_server_info_reads_vllm_032_layout() -> None:
    answer = {
        "vllm_config": {
            "model_config": {"model": "/m", "dtype": "torch.bfloat16", "served_model_name": "/m"},
            "weight_transfer_config": {"backend": "gloo"},
        }
    }
    assert parse_server_info(answer) == ServerInfo("/m", torch.bfloat16, "gloo", "/m")
    answer["vllm_config"]["weight_transfer_config"] = None
    assert parse_server_info(answer).weight_transfer_backend is None
    with pytest.raises(ValueError, match="model_config"):
        parse_server_info({"vllm_config": {}})


def test_server_address_from_trl_args() -> None:
    args = SimpleNamespace(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=None,
        vllm_server_host="10.0.0.5",
        vllm_server_port=8001,
        vllm_server_timeout=30.0,
        vllm_group_port=5000,
    )
    address = server_address(args)
    assert address is not None and address.base_url == "http://10.0.0.5:8001" and address.group_port == 5000
    args.vllm_server_base_url = "http://h:9/"
    assert server_address(args).base_url == "http://h:9"  # type: ignore[union-attr]
    args.vllm_mode = "colocate"
    assert server_address(args) is None


def test_trl_communicator_is_deferred_only_while_the_trainer_is_built() -> None:
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator
    with defer_trl_weight_communicator():
        assert VLLMClient.init_communicator is not original
        assert VLLMClient.init_communicator(object(), device="cpu") is None
    assert VLLMClient.init_communicator is original


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a trainer without CUDA")
def test_trl_device_argument_of_the_deferred_communicator_works_without_cuda() -> None:
    """TRL 0.28-1.9 evaluate `torch.cuda.current_device()` for the deferred call (regression: TRL 0.29 server mode
    on a CPU trainer died with "Torch not compiled with CUDA enabled" before the mixin's deferral could help)."""
    from trl.generation.vllm_client import VLLMClient

    with defer_trl_weight_communicator():
        assert VLLMClient.init_communicator(object(), device=torch.cuda.current_device()) is None
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.current_device()


def _unplanned_between(sync: WeightSync) -> None:
    """The model grew after the plan: an unplanned parameter streams between the two planned ones."""
    values = sync.gatherer.values  # type: ignore[attr-defined]
    first, second = list(values.items())
    values.clear()
    values.update([first, ("_fsdp_wrapped_module.c.new", torch.zeros(1)), second])


def test_a_stream_failure_aborts_the_gloo_round_and_keeps_the_transfer(recording) -> None:
    """gloo ends a round part-way on the server (its abort marker): the transfer stays set up, the open update
    session is closed before the next round, and nothing is re-hosted on the group port."""
    from fsdp_sync.sync.stream import IncompleteSyncError

    sync, client = recording
    sync.sync()
    saved = dict(sync.gatherer.values)
    _unplanned_between(sync)
    with pytest.raises(IncompleteSyncError) as err:
        sync.sync()
    assert err.value.engine is not None and err.value.engine.status == "mixed"
    sync.gatherer.values.clear()
    sync.gatherer.values.update(saved)
    sync.sync()
    assert len(RecordingEngine.instances) == 1, "the transfer must be kept, not set up again"
    assert client.finishes == 1, "the session the aborted round left open is closed first"


def test_a_backend_that_cannot_abort_gets_placeholders_and_says_so(recording) -> None:
    """vLLM's NCCL backend cannot end a round early: after the stream fails, the announced tensors still to come are
    sent as zeros so the server finishes the round, and the error names them as undefined on the server."""
    from dataclasses import replace

    from fsdp_sync.sync.stream import IncompleteSyncError

    sync, _ = recording
    sync.writer.transport = replace(sync.writer.transport, aborts_round=False)
    sync.sync()
    _unplanned_between(sync)
    with pytest.raises(IncompleteSyncError) as err:
        sync.sync()
    engine = err.value.engine
    assert engine is not None and engine.status == "undefined" and engine.undefined == ("a.index",), engine
    _, sent = RecordingEngine.instances[0].rounds[-1]
    assert [name for name, _ in sent] == ["b.weight", "a.index"]
    assert not sent[1][1].any(), "the placeholder is zeros"


def test_a_new_selection_is_announced_through_the_source_the_engine_holds(recording) -> None:
    """A delta sync announces fewer tensors: the transfer engine built at the first sync must read the new metadata
    (regression: 'the weight stream was already consumed'). A source's metadata never changes (vLLM 0.33+ requires
    it), so the writer hands the engine a new source."""
    sync, _ = recording
    sync.sync()
    engine = RecordingEngine.instances[0]
    first = [m.name for m in source_metadata(engine.source)]
    planned = sync.checked_plan.tensors
    sync.writer.prepare(planned[:1])
    assert [m.name for m in source_metadata(engine.source)] == [planned[0].name] != first


class ChecksumClient(FakeClient):
    """Answers the server's per-parameter digests (one packed away), counting how often it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.checksum_reads = 0

    def weight_checksums(self) -> dict[str, str]:
        self.checksum_reads += 1
        return {"0:b.weight": "ab" * 32, "0:a.index": EMPTY_DIGEST}


def test_a_plan_reads_the_servers_digests_once(tmp_path: Path) -> None:
    """A sparse plan asks the server for its parameter names, whether it can take patches and which weights it packed
    away: one read of its digests (each makes the server hash every weight) answers all three; the next plan reads
    them anew, and verify's digests after a push are always fresh."""
    client = ChecksumClient()
    writer = ServerWriter(client, _info(), group_port=12345, checkpoint_dir=str(tmp_path), buffer_bytes=1024,  # type: ignore[arg-type]
                          timeout_s=5)  # fmt: skip
    for plan in (1, 2):
        layout = writer.engine_layout()
        assert writer.sparse_refusal() is None
        assert set(writer.patch_refusals()) == {"a.index"}
        assert layout.modules == frozenset({"b", "a"})
        assert client.checksum_reads == plan
        writer.prepare([])  # the plan is announced
    writer.engine_digests()
    writer.engine_digests()
    assert client.checksum_reads == 4
