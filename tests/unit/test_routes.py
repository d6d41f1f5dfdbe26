"""Routed dense updates (`fsdp_sync.transfer.routes`, `gloo_trainer.RouteSender`, `gloo_wire.routed_chunks`): the
cuts read from the workers' rules, the senders balanced by bytes, and a real gloo route group (two trainer ranks and
two workers, threads of this process) over which each worker receives exactly its cut of every tensor from the rank
its route names, and an abort from whichever rank it waits for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta

from fsdp_sync.compat.tp_shards import expected_shard
from fsdp_sync.transfer.gloo_route import RouteSender
from fsdp_sync.transfer.gloo_wire import TRAILER, UpdateAborted, plan_chunks, routed_chunks
from fsdp_sync.transfer.routes import plan_cuts, plan_route, take, widen

pytestmark = pytest.mark.unit

# Qwen2-like: q/k/v packed into qkv_proj, o_proj row-parallel, a padded vocabulary, a norm.
NAMES = ["embed.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "norm.weight"]
SHAPES = [(10, 4), (8, 4), (4, 4), (4, 4), (4, 8), (4,)]
PACKED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3)}


def _parameter(name: str) -> tuple[str, int, int]:
    module, _, leaf = name.rpartition(".")
    fused, index, parts = PACKED.get(module, (module, 0, 1))
    return f"{fused}.{leaf}", index, parts


def _rules(tp_rank: int) -> dict:
    return {
        "embed.weight": {"dim": 0, "parts": [[5 * tp_rank, 5]], "rows": 6},
        "qkv_proj.weight": {"dim": 0, "parts": [[4 * tp_rank, 4], [2 * tp_rank, 2], [2 * tp_rank, 2]], "rows": None},
        "o_proj.weight": {"dim": 1, "parts": [[4 * tp_rank, 4]], "rows": None},
        "norm.weight": {"dim": None},
    }


def test_cuts_are_what_each_workers_loader_reads_and_unknown_layers_go_whole() -> None:
    rules = [_rules(0), _rules(1)]
    rules[1]["o_proj.weight"] = None  # a layer tp_shards does not know: never guessed
    cuts, whole = plan_cuts(NAMES, SHAPES, _parameter, rules)
    assert cuts[0] == [[0, 0, 5], [0, 0, 4], [0, 0, 2], [0, 0, 2], [1, 0, 4], None]
    assert cuts[1] == [[0, 5, 5], [0, 4, 4], [0, 2, 2], [0, 2, 2], None, None]
    assert whole == []  # a rule-less layer is whole without a note; a rule that disagrees is noted
    rules[0]["qkv_proj.weight"] = {"dim": 0, "parts": [[0, 4]], "rows": None}  # packing disagrees with the naming
    cuts, whole = plan_cuts(NAMES, SHAPES, _parameter, rules)
    assert cuts[0][1:4] == [None, None, None] and whole == ["q_proj.weight", "k_proj.weight", "v_proj.weight"]


def test_widened_cuts_give_each_worker_the_shard_its_loader_keeps() -> None:
    torch.manual_seed(0)
    tensors = {n: torch.randn(s, dtype=torch.bfloat16) for n, s in zip(NAMES, SHAPES)}
    cuts, _ = plan_cuts(NAMES, SHAPES, _parameter, [_rules(0), _rules(1)])
    for place in (0, 1):
        received = {n: widen(take(tensors[n], c).contiguous(), s, c) for n, s, c in zip(NAMES, SHAPES, cuts[place])}
        rules = _rules(place)
        qkv = [received[n] for n in NAMES[1:4]]
        assert torch.equal(
            expected_shard(qkv, rules["qkv_proj.weight"]), expected_shard([tensors[n] for n in NAMES[1:4]], rules["qkv_proj.weight"])
        )
        for name, engine in (("embed.weight", "embed.weight"), ("o_proj.weight", "o_proj.weight")):
            assert torch.equal(expected_shard([received[name]], rules[engine]), expected_shard([tensors[name]], rules[engine]))
        assert torch.equal(received["norm.weight"], tensors["norm.weight"])


def test_chunks_are_spread_over_the_senders_by_bytes() -> None:
    shapes = [(256, 64)] * 12
    dtypes = [torch.float32] * 12
    cuts = [[[0, 0, 128]] * 12, [[0, 128, 128]] * 12]  # TP2: each worker half of every tensor
    route = plan_route(shapes, dtypes, cuts, senders=3, workers=4, buffer_bytes=2 * 128 * 64 * 4, tag=7)
    assert [len(s) for s in route.sources] == [6, 6, 6, 6]
    sent = [sum(1 for s in route.sources for r in s if r == rank) for rank in range(3)]
    assert sent == [8, 8, 8]  # 24 equal chunks over 3 ranks
    assert route.sizes(2, shapes, dtypes) == [128 * 64 * 4] * 12  # worker 2 is at place 0 of the second replica
    # a buffer far larger than a worker's stream: chunks of a quarter of a sender's share (balance), and the senders
    # named chunk by chunk as both ends cut the stream
    big = plan_route(shapes, dtypes, cuts, senders=3, workers=2, buffer_bytes=1 << 30)
    assert big.buffer_bytes == 64 * 2**10  # a quarter of a sender's share (32 KiB) is under the smallest chunk
    for w in range(2):
        assert len(big.sources[w]) == len(plan_chunks(big.sizes(w, shapes, dtypes), big.buffer_bytes)) == 6
    assert [sum(1 for s in big.sources for r in s if r == rank) for rank in range(3)] == [4, 4, 4]
    with pytest.raises(ValueError, match="whole replicas"):
        plan_route(shapes, dtypes, cuts, senders=2, workers=3, buffer_bytes=1 << 20)


def _group(store: dist.Store, rank: int, world: int) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=30)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, options)


def _two_and_two(trainer: Callable[[int], None], worker: Callable[[int], None]) -> None:
    """Two trainer ranks and two workers of one route group, each a thread of this process, run to their end."""
    threads = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)]
    threads += [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def _run_route(fail_at: int | None) -> tuple[dict[int, list], dict[int, BaseException], list[RouteSender]]:
    """Two trainer ranks send a routed update of NAMES to two TP workers over a real gloo group (threads); with
    `fail_at`, rank 1's stream fails at that tensor (rank 0's stops there too, as at the gather's next round)."""
    torch.manual_seed(1)
    tensors = [torch.randn(s, dtype=torch.bfloat16) for s in SHAPES]
    meta = [ParamMeta(n, torch.bfloat16, s) for n, s in zip(NAMES, SHAPES)]
    cuts, _ = plan_cuts(NAMES, SHAPES, _parameter, [_rules(0), _rules(1)])
    # 3 tensors' cuts a chunk at most: several chunks per worker, from both ranks
    route = plan_route(SHAPES, [torch.bfloat16] * 6, cuts, senders=2, workers=2, buffer_bytes=200, tag=3)
    assert all(len(s) >= 2 for s in route.sources) and {r for s in route.sources for r in s} == {0, 1}, route.sources
    store = dist.HashStore()
    received: dict[int, list] = {}
    errors: dict[int, BaseException] = {}
    senders: list[RouteSender] = []

    def stream(rank: int):
        for i, (m, t) in enumerate(zip(meta, tensors)):
            if fail_at is not None and i == fail_at:
                raise RuntimeError(f"rank {rank} stopped")
            yield m.name, t

    def trainer(rank: int) -> None:
        group = _group(store, rank, 4)
        sender = RouteSender(group, route, rank, lambda work: work.wait(timedelta(seconds=30)))
        senders.append(sender)
        try:
            sender.send(stream(rank), meta)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    def worker(w: int) -> None:
        group = _group(store, 2 + w, 4)
        sizes = route.sizes(w, SHAPES, [torch.bfloat16] * 6)
        out = received[w] = []
        try:
            for chunk, buffer in routed_chunks(group, sizes, route.buffer_bytes, route.sources[w], route.tag, "here"):
                for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                    flat = buffer[offset : offset + sizes[i]].view(torch.bfloat16)
                    out.append(widen(flat, SHAPES[i], route.cuts_of(w)[i]))
        except BaseException as e:  # noqa: BLE001
            errors[2 + w] = e

    _two_and_two(trainer, worker)
    expected = {w: [take(t, c) for t, c in zip(tensors, route.cuts_of(w))] for w in (0, 1)}
    for w, got in received.items():
        for i, full in enumerate(got):
            assert torch.equal(take(full, route.cuts_of(w)[i]), expected[w][i]), (w, NAMES[i])
    return received, errors, senders


def test_each_worker_receives_exactly_its_cut_from_the_rank_its_route_names() -> None:
    received, errors, senders = _run_route(None)
    assert not errors, errors
    assert [len(received[w]) for w in (0, 1)] == [6, 6]
    # both ranks sent a share; together exactly the chunks of both workers' cuts (about half of every full tensor
    # each, the norm whole), never a full tensor to a worker that keeps half of it
    route = senders[0].route
    chunk_bytes = sum(
        c.nbytes + TRAILER for w in (0, 1) for c in plan_chunks(route.sizes(w, SHAPES, [torch.bfloat16] * 6), route.buffer_bytes)
    )
    assert all(s.sent_bytes > 0 for s in senders) and sum(s.sent_bytes for s in senders) == chunk_bytes
    cut = sum(sum(route.sizes(w, SHAPES, [torch.bfloat16] * 6)) for w in (0, 1))
    full = sum(2 * torch.Size(s).numel() for s in SHAPES)  # bf16 bytes of every full tensor
    assert cut == 2 * 2 * (20 + 16 + 8 + 8 + 16 + 4) and cut < 2 * full * 0.55  # halves, the norm whole


def test_a_stream_that_stops_part_way_aborts_every_worker_at_once() -> None:
    received, errors, senders = _run_route(fail_at=3)
    assert isinstance(errors[0], RuntimeError) and isinstance(errors[1], RuntimeError)
    for w in (0, 1):
        assert isinstance(errors[2 + w], UpdateAborted), errors
        assert len(received[w]) < 6  # the tensors of the chunks completed before the stop, nothing after


class _TwoWorkerClient:
    """A tensor-parallel server of two workers, as the sender asks it (its workers and their cuts)."""

    base_url = "http://127.0.0.1:1"

    def world_size(self) -> int:
        return 2

    def shard_rules(self) -> dict:
        return {f"pp0:pcp0:tp{i}": {"qkv_proj.weight": _rules(i)["qkv_proj.weight"]} for i in (0, 1)}


def test_the_sender_plans_each_push_from_the_workers_cuts_and_sets_the_route_up_once(monkeypatch, tmp_path) -> None:
    """`ServerRoutes.route_ticket`: the first push sets the transfer up (a store listens on the group port for the
    other ranks), later ones reuse it; each worker's cut comes from its own rules, by place; a tensor no rule cuts
    goes whole; a server of one worker is not routed. After a failed routed push every rank drops its
    transfer; a broadcast push's failure keeps it."""
    from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.writers import server_routes
    from fsdp_sync.writers.server import ServerWriter
    from tests.support.dist import free_port

    info = ServerInfo(model=str(tmp_path), dtype=torch.bfloat16, weight_transfer_backend="gloo", served_name="m")
    writer = ServerWriter(_TwoWorkerClient(), info, group_port=free_port(), buffer_bytes=1 << 20, timeout_s=5)  # type: ignore[arg-type]
    monkeypatch.setattr(server_routes, "world_size", lambda: 2)
    monkeypatch.setattr(server_routes, "engine_naming_for_architectures", lambda _: type("N", (), {"parameter": staticmethod(_parameter)})())
    planned = [PlannedTensor(n, TensorSpec(s, torch.bfloat16), (n,)) for n, s in zip(NAMES, SHAPES)]
    writer.prepare(planned)
    first = writer.route_ticket()
    assert first is not None and first.connect and first.workers == 2 and writer._route_host is not None
    route = first.route
    assert route["senders"] == 2 and route["replica"] == 2
    assert route["cuts"][1][1:4] == [[0, 4, 4], [0, 2, 2], [0, 2, 2]]  # q, k, v: worker 1's rows, by its rules
    assert route["cuts"][0][0] is None and route["cuts"][0][4] is None  # no rule: whole
    writer._engine = type(
        "Engine", (), {"route_group": object(), "shutdown": lambda self: None, "bound": lambda self, deadline: None}
    )()
    second = writer.route_ticket()
    assert second is not None and not second.connect and second.route["tag"] == route["tag"] + 1
    # a sparse update over the same transfer: routed by the same workers' cuts, with a tag of its own
    routed = writer.patch_route(_patches())
    assert routed is not None and routed[0].counts is not None and routed[0].cuts == route["cuts"]
    assert routed[0].tag == route["tag"] + 2 and routed[0].workers == 2
    # what a rank sent is counted per sync: each sync's bound starts the count afresh
    writer._engine.sent_bytes, writer._engine.worker_bytes = 7, [3, 4]
    writer.bound(time.monotonic() + 5)
    assert writer._engine.sent_bytes == 0 and writer._engine.worker_bytes == []
    writer.shares = False
    assert writer.patch_route(_patches()) is None  # a writer that does not route broadcasts patches too
    writer.shares = True
    # workers that each hold every patched tensor whole (here: only the norm and the embedding, which no rule cuts)
    # receive every change: broadcast
    assert writer.patch_route([p for p in _patches() if p.name in ("norm.weight", "embed.weight")]) is None
    writer.take_ticket(None)
    writer.route_failed()
    assert writer._engine is not None, "a broadcast push's failure keeps the transfer"
    writer.take_ticket(second)
    writer.route_failed()
    assert writer._engine is None and writer._route_host is None
    monkeypatch.setattr(_TwoWorkerClient, "world_size", lambda self: 1)
    assert writer.route_ticket() is None  # a server of one worker: broadcast, from 2 ranks too


def _patches(seed: int = 2) -> list:
    """A patch of every tensor of NAMES: about a third of its elements changed, at random places."""
    from fsdp_sync.compat.patch_api import EnginePatch

    g = torch.Generator().manual_seed(seed)
    patches = []
    for name, shape in zip(NAMES, SHAPES):
        numel = torch.Size(shape).numel()
        indices = torch.nonzero(torch.rand(numel, generator=g) < 0.35).flatten()
        values = torch.randn(indices.numel(), generator=g).to(torch.bfloat16)
        patches.append(EnginePatch(name, shape, torch.bfloat16, indices, values))
    return patches


def _applied(patch, shape) -> torch.Tensor:
    """The patch written into zeros (NaN marks what it did not write)."""
    out = torch.full((torch.Size(shape).numel(),), float("nan"), dtype=torch.bfloat16)
    out[patch.indices] = patch.values
    return out.view(shape)


def test_in_cut_selects_the_flat_indices_inside_a_row_or_column_cut() -> None:
    from fsdp_sync.transfer.routes import in_cut

    shape = (4, 6)
    every = torch.arange(24)
    assert in_cut(every, shape, None) is None
    rows = in_cut(every, shape, [0, 1, 2])
    assert torch.equal(every[rows], torch.arange(6, 18))  # rows 1 and 2
    columns = in_cut(every, shape, [1, 3, 3])
    assert torch.equal(every[columns].view(4, 3), torch.arange(24).view(4, 6)[:, 3:6])
    middle = in_cut(torch.arange(2 * 4 * 6), (2, 4, 6), [1, 2, 2])  # the middle dimension of a 3-d tensor
    assert torch.equal(torch.arange(48)[middle].view(2, 2, 6), torch.arange(48).view(2, 4, 6)[:, 2:4])


def test_each_worker_receives_only_the_patches_inside_its_cut_from_rank_0() -> None:
    """A routed sparse update over a real gloo route group (two trainer ranks, two TP workers, threads): rank 0, which
    holds the gathered patches, sends each worker the changes inside its cut, still indexed into the full tensor;
    rank 1 sends nothing. Each worker's decoded patches write exactly what the whole patches write inside its cut,
    nothing outside it; a tensor it holds whole (the norm) arrives whole, encoded once for both."""
    from fsdp_sync.patch_codec import decode_patch
    from fsdp_sync.transfer.routes import route_patches

    patches = _patches()
    cuts, _ = plan_cuts(NAMES, SHAPES, _parameter, [_rules(0), _rules(1)])
    route, encoded = route_patches(patches, cuts, senders=2, workers=2, buffer_bytes=256, tag=5)
    assert all(len(s) >= 2 for s in route.sources) and {r for s in route.sources for r in s} == {0}, route.sources
    assert encoded[5][0] is encoded[5][1]  # the norm: one encoding for both places
    dtypes = [torch.bfloat16] * 6
    sizes = [route.sizes(w, SHAPES, dtypes) for w in (0, 1)]
    store = dist.HashStore()
    received: dict[int, list] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}
    senders: list[RouteSender] = []

    def trainer(rank: int) -> None:
        group = _group(store, rank, 4)
        if rank != 0:
            return  # a member of the route group with nothing to send
        sender = RouteSender(group, route, rank, lambda work: work.wait(timedelta(seconds=30)))
        senders.append(sender)
        try:
            sender.send_parts((parts for tensor in encoded for parts in zip(*tensor, strict=True)), sizes)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    def worker(w: int) -> None:
        group = _group(store, 2 + w, 4)
        segments: list[torch.Tensor] = []
        try:
            for chunk, buffer in routed_chunks(group, sizes[w], route.buffer_bytes, route.sources[w], route.tag, "x"):
                segments += [buffer[o : o + sizes[w][i]] for i, o in zip(range(chunk.start, chunk.stop), chunk.offsets)]
            received[w] = [
                decode_patch(p.name, p.shape, p.dtype, *segments[3 * k : 3 * k + 3]) for k, p in enumerate(patches)
            ]
        except BaseException as e:  # noqa: BLE001
            errors[2 + w] = e

    _two_and_two(trainer, worker)
    assert not errors, errors
    for w in (0, 1):
        assert [p.indices.numel() for p in received[w]] == route.counts_of(w)
        for k, (whole, got) in enumerate(zip(patches, received[w], strict=True)):
            cut = route.cuts_of(w)[k]
            mine, full = _applied(got, whole.shape), _applied(whole, whole.shape)
            torch.testing.assert_close(take(mine, cut), take(full, cut), rtol=0, atol=0, equal_nan=True, msg=NAMES[k])
            outside = mine.isnan().logical_not().sum() - take(mine, cut).isnan().logical_not().sum()
            assert outside == 0, (w, NAMES[k])  # nothing outside its cut travelled
    # each worker about half of every cut tensor's changes, the norm's whole; all from rank 0
    total = [p.indices.numel() for p in patches]
    for w in (0, 1):
        assert route.counts_of(w)[5] == total[5] and all(c < t for c, t in zip(route.counts_of(w)[:5], total[:5]))
    assert [route.counts_of(0)[k] + route.counts_of(1)[k] for k in range(5)] == total[:5]
    assert senders[0].worker_bytes == [sum(c.nbytes + TRAILER for c in plan_chunks(sizes[w], 256)) for w in (0, 1)]


def test_a_server_failure_from_another_ranks_abort_is_that_ranks_not_this_ones(monkeypatch, tmp_path) -> None:
    """Regression (CI rehearsal 7, the routed fault test into the data-parallel server): rank 1 failed part-way through
    its share and aborted the update; under load the server's answer (its workers' `UpdateAborted`) reached rank 0
    before the gather's next round, and rank 0 recorded a failure of its own, so both ranks were named. The server's
    error quoting another rank's abort is now the cause of an interruption, which the push does not count as this
    rank's failure; its own abort, or any other server failure, stays its own."""
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.errors import StreamInterrupted
    from fsdp_sync.server_client import ServerRequestError
    from fsdp_sync.transfer.gloo_wire import aborted_by, routed_abort
    from fsdp_sync.writers import server as server_module
    from fsdp_sync.writers.server import ServerWriter
    from fsdp_sync.writers.server_routes import RouteTicket
    from tests.support.dist import free_port

    # the worker's failure as the server's error answer quotes it
    quoted = f"gloo weight transfer was aborted by the trainer (UpdateAborted: {routed_abort(1, '(routed)')}). ..."
    assert aborted_by(quoted) == 1 and aborted_by("the worker's loader failed") is None
    info = ServerInfo(model=str(tmp_path), dtype=torch.bfloat16, weight_transfer_backend="gloo", served_name="m")
    writer = ServerWriter(_TwoWorkerClient(), info, group_port=free_port(), buffer_bytes=1 << 20, timeout_s=5)  # type: ignore[arg-type]
    monkeypatch.setattr(server_module, "rank", lambda: 0)
    error = ServerRequestError(quoted)
    assert writer._routed_cause(error) is error  # not a routed push: the server's failure is this rank's
    writer._ticket = RouteTicket(False, "127.0.0.1", 1, 2, {})
    cause = writer._routed_cause(error)
    assert isinstance(cause, StreamInterrupted) and cause.__cause__ is error and "trainer rank 1" in str(cause)
    own = ServerRequestError(quoted.replace("trainer rank 1", "trainer rank 0"))
    assert writer._routed_cause(own) is own  # its own abort: its own failure, recorded where its stream failed
    other = ServerRequestError("the worker's loader failed")
    assert writer._routed_cause(other) is other
