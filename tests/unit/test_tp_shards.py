"""The cut of a full weight each tensor-parallel worker holds (`compat.tp_shards`), checked against vLLM's own layers:
each layer is built as worker `rank` of `size` would build it (vLLM's tp rank and size getters patched, no process
group), the full tensors are loaded through the layer's own weight loader, and what the parameter then holds must
equal `expected_shard` of the full tensors under the rule read off the layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from fsdp_sync.compat.tp_shards import expected_shard, shard_rule, shard_rules  # noqa: E402

_GETTERS = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size")


@pytest.fixture
def as_worker(monkeypatch: pytest.MonkeyPatch):
    """`as_worker(rank, size)`: vLLM's layers built afterwards are worker `rank` of `size`."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    def set_worker(rank: int, size: int) -> None:
        for module in (linear, vocab, parameter):
            monkeypatch.setattr(module, _GETTERS[0], lambda: rank, raising=False)
            monkeypatch.setattr(module, _GETTERS[1], lambda: size, raising=False)

    return set_worker


def _loaded(layer: torch.nn.Module, param: torch.nn.Parameter, parts: list[tuple[torch.Tensor, object]]) -> None:
    for tensor, shard_id in parts:
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 1), (2, 2), (4, 2)])
def test_every_worker_holds_the_cut_of_the_full_weight_its_loader_makes(as_worker, size: int, kv_heads: int) -> None:
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    hidden, head, heads, inter, vocab = 128, 32, 4, 96, 100  # vocab not a multiple of the 64-row padding
    full = {
        "q": torch.randn(heads * head, hidden), "k": torch.randn(kv_heads * head, hidden),
        "v": torch.randn(kv_heads * head, hidden), "qb": torch.randn(heads * head),
        "kb": torch.randn(kv_heads * head), "vb": torch.randn(kv_heads * head),
        "gate": torch.randn(inter, hidden), "up": torch.randn(inter, hidden), "down": torch.randn(hidden, inter),
        "down_b": torch.randn(hidden), "col": torch.randn(64, hidden), "col_b": torch.randn(64),
        "emb": torch.randn(vocab, hidden), "head": torch.randn(vocab, hidden),
    }  # fmt: skip
    for rank in range(size):
        as_worker(rank, size)
        kw = {"params_dtype": torch.float32}
        qkv = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, **kw)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, **kw)
        down = RowParallelLinear(inter, hidden, bias=True, **kw)
        col = ColumnParallelLinear(hidden, 64, bias=True, **kw)
        emb = VocabParallelEmbedding(vocab, hidden, **kw)
        lm_head = ParallelLMHead(vocab, hidden, **kw)
        cases = [
            (qkv, qkv.weight, [(full["q"], "q"), (full["k"], "k"), (full["v"], "v")]),
            (qkv, qkv.bias, [(full["qb"], "q"), (full["kb"], "k"), (full["vb"], "v")]),
            (gate_up, gate_up.weight, [(full["gate"], 0), (full["up"], 1)]),
            (down, down.weight, [(full["down"], None)]),
            (down, down.bias, [(full["down_b"], None)]),
            (col, col.weight, [(full["col"], None)]),
            (col, col.bias, [(full["col_b"], None)]),
            (emb, emb.weight, [(full["emb"], None)]),
            (lm_head, lm_head.weight, [(full["head"], None)]),
        ]
        for layer, param, parts in cases:
            _loaded(layer, param, parts)
            rule = shard_rule(layer, param)
            assert rule is not None, type(layer).__name__
            got = expected_shard([t for t, _ in parts], rule)
            assert torch.equal(param.data, got), (type(layer).__name__, rank, rule)
        assert shard_rule(down, down.bias) == {"dim": None}, "a row layer's bias is whole on every worker"
        rules = shard_rules(torch.nn.ModuleDict({"qkv": qkv, "down": down}))
        assert set(rules) == {"qkv.weight", "qkv.bias", "down.weight", "down.bias"}
    # the workers' shards differ (nothing passes by every worker holding the same thing) where heads are not shared
    q_rows = heads * head // size
    assert not torch.equal(expected_shard([full["q"]], {"dim": 0, "parts": [[0, q_rows]]}),
                           expected_shard([full["q"]], {"dim": 0, "parts": [[q_rows, q_rows]]}))  # fmt: skip


def test_a_single_worker_holds_every_weight_whole(as_worker) -> None:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    as_worker(0, 1)
    qkv = QKVParallelLinear(128, 32, 4, 1, bias=False, params_dtype=torch.float32)
    assert shard_rule(qkv, qkv.weight) == {"dim": None}
    parts = [torch.randn(128, 128), torch.randn(32, 128), torch.randn(32, 128)]
    assert torch.equal(expected_shard(parts, {"dim": None}), torch.cat(parts))


def test_a_rule_with_the_wrong_number_of_parts_is_refused() -> None:
    with pytest.raises(ValueError, match="cuts 2 part"):
        expected_shard([torch.zeros(4, 2)], {"dim": 0, "parts": [[0, 2], [0, 2]]})


def test_the_per_worker_check_compares_each_shard_and_names_what_differs() -> None:
    """`worker_digest_check` (the demo's server check): each worker's digest against its cut of the full weight.
    The old check's mistake, a TP worker's shard read as the whole tensor, and the whole tensor where a shard is
    held, both fail; a weight whose cut is unknown is a problem, never a pass."""
    from fsdp_sync._demo.engine import tensor_digest, worker_digest_check

    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    checkpoint = {"l.q_proj.weight": q, "l.k_proj.weight": k, "l.v_proj.weight": v, "norm.weight": torch.randn(4)}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    rules = {
        f"dp0:pp0:pcp0:tp{r}": {
            "l.qkv_proj.weight": {"dim": 0, "parts": [[4 * r, 4], [0, 4], [0, 4]], "rows": None},
            "norm.weight": {"dim": None},
        }
        for r in range(2)
    }
    workers = {
        w: {
            "l.qkv_proj.weight": tensor_digest(expected_shard([q, k, v], rules[w]["l.qkv_proj.weight"])),
            "norm.weight": tensor_digest(checkpoint["norm.weight"]),
        }
        for w in rules
    }
    assert worker_digest_check(workers, rules, checkpoint, packed, torch.float32) == (4, [])
    whole = dict(workers)
    tp1 = "dp0:pp0:pcp0:tp1"
    whole[tp1] = {**workers[tp1], "l.qkv_proj.weight": tensor_digest(torch.cat([q, k, v]))}
    checked, problems = worker_digest_check(whole, rules, checkpoint, packed, torch.float32)
    assert checked == 4 and len(problems) == 1 and problems[0].startswith(f"{tp1}:l.qkv_proj.weight"), problems
    unknown = {w: {**r, "l.qkv_proj.weight": None} for w, r in rules.items()}
    _, problems = worker_digest_check(workers, unknown, checkpoint, packed, torch.float32)
    assert len(problems) == 2 and all("not known" in p for p in problems), problems
    _, problems = worker_digest_check(workers, {}, checkpoint, packed, torch.float32)
    assert len(problems) == 2 and all("did not say" in p for p in problems), problems


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 1), (4, 2)])
def test_verify_hashes_each_workers_cut_as_the_full_tensors_stream(as_worker, size: int, kv_heads: int) -> None:
    """`SyncConfig(verify=True)` on a tensor-parallel engine (`EngineDigests` with the workers' shard rules): the
    full tensors, sent one by one (fused parts out of order), are hashed as every worker's loader cuts them, and
    every worker's digest of what its own layers loaded matches (q/k/v and gate/up packed, a row layer cut along its
    columns, a padded vocabulary). A worker holding another cut, or the whole tensor, is a mismatch named with the
    worker; a sharded engine that gives no cuts is unverifiable, never a pass."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from fsdp_sync.compat.engine_api import EngineNaming
    from fsdp_sync.digest import tensor_digest
    from fsdp_sync.sync.verify import EngineDigests

    torch.manual_seed(0)
    hidden, head, heads, inter, vocab = 128, 32, 4, 96, 100
    sent = {
        "l.q_proj.weight": torch.randn(heads * head, hidden), "l.k_proj.weight": torch.randn(kv_heads * head, hidden),
        "l.v_proj.weight": torch.randn(kv_heads * head, hidden), "l.q_proj.bias": torch.randn(heads * head),
        "l.k_proj.bias": torch.randn(kv_heads * head), "l.v_proj.bias": torch.randn(kv_heads * head),
        "l.gate_proj.weight": torch.randn(inter, hidden), "l.up_proj.weight": torch.randn(inter, hidden),
        "l.down_proj.weight": torch.randn(hidden, inter), "l.down_proj.bias": torch.randn(hidden),
        "lm_head.weight": torch.randn(vocab, hidden),
    }  # fmt: skip
    workers: dict[str, dict[str, str]] = {}
    rules: dict[str, dict] = {}
    for rank in range(size):
        as_worker(rank, size)
        kw = {"params_dtype": torch.float32}
        model = torch.nn.Module()
        model.l = torch.nn.Module()
        model.l.qkv_proj = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, **kw)
        model.l.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, **kw)
        model.l.down_proj = RowParallelLinear(inter, hidden, bias=True, **kw)
        model.lm_head = ParallelLMHead(vocab, hidden, **kw)
        for part in ("q", "k", "v"):
            for leaf in ("weight", "bias"):
                param = getattr(model.l.qkv_proj, leaf)
                param.weight_loader(param, sent[f"l.{part}_proj.{leaf}"], part)
        for i, part in enumerate(("gate", "up")):
            param = model.l.gate_up_proj.weight
            param.weight_loader(param, sent[f"l.{part}_proj.weight"], i)
        for name in ("l.down_proj.weight", "l.down_proj.bias", "lm_head.weight"):
            param = model.get_parameter(name)
            param.weight_loader(param, sent[name])
        place = f"pp0:pcp0:tp{rank}"
        rules[place] = shard_rules(model)
        workers[f"dp0:{place}"] = {name: tensor_digest(p.data) for name, p in model.named_parameters()}

    naming = EngineNaming({"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]})

    def streamed(shard_rules_by_place: dict | None) -> EngineDigests:
        digests = EngineDigests(naming, shard_rules=shard_rules_by_place)
        for name in sorted(sent, reverse=True):  # v before k before q, up before gate
            digests.add(name, sent[name])
        return digests

    result = streamed(rules).compare(workers, sharded=True)
    assert result.mismatched == [] and result.unverifiable == {}, (result.mismatched, result.unverifiable)
    assert result.checked == 6 * size  # qkv weight and bias, gate_up, down weight and bias, lm_head: per worker
    assert len({d["l.qkv_proj.weight"] for d in workers.values()}) == size, "the workers hold different cuts"

    tp1 = "dp0:pp0:pcp0:tp1"
    tp0_gate_up = workers["dp0:pp0:pcp0:tp0"]["l.gate_up_proj.weight"]
    swapped = {**workers, tp1: {**workers[tp1], "l.gate_up_proj.weight": tp0_gate_up}}
    held_whole = {**workers, tp1: {**workers[tp1], "lm_head.weight": tensor_digest(sent["lm_head.weight"])}}
    assert streamed(rules).compare(swapped, sharded=True).mismatched == [f"l.gate_up_proj.weight (worker {tp1})"]
    assert streamed(rules).compare(held_whole, sharded=True).mismatched == [f"lm_head.weight (worker {tp1})"]

    blind = streamed(None).compare(workers, sharded=True)
    assert blind.checked == 0 and blind.mismatched == []
    assert len(blind.unverifiable) == sum(len(d) for d in workers.values())
    assert all("did not say how" in why for why in blind.unverifiable.values())
