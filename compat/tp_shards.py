"""Which part of a full weight each tensor-parallel worker of a vLLM engine holds, as vLLM's own loaders cut it
(vLLM 0.32's `vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`; the same cuts 0.28-0.34).

Why: a tensor-parallel server holds a shard of most weights on each worker, and its digests (`/weight_checker`) are
per worker, of the shard. A check that compares them with the trainer's full weight must cut that weight exactly as
the worker's loader did. The cut is read off the worker's own layers (`shard_rules`, run inside the worker: layer
class, its tp rank and size, its head and vocabulary partitioning), so the trainer side (`expected_shard`) only
applies it, with no model knowledge of its own.

The cuts, per layer (unquantized weights):
- `ColumnParallelLinear`: rows `[rank * n, (rank + 1) * n)` of the weight and bias, `n` the worker's rows.
- `MergedColumnParallelLinear` (gate/up): each part cut like a column layer, the cuts concatenated in order.
- `QKVParallelLinear`: q cut by the rank; k and v by `rank // num_kv_head_replicas` (a KV head is replicated on
  several workers when there are fewer KV heads than workers), concatenated q, k, v.
- `RowParallelLinear`: columns `[rank * n, (rank + 1) * n)` of the weight; the bias whole on every worker.
- `VocabParallelEmbedding` / `ParallelLMHead`: the rows of the worker's vocabulary range, then zero rows up to the
  worker's padded partition.
- Anything without a partitioned dimension (norms, replicated layers, every weight at tp size 1): whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ShardRule", "expected_shard", "shard_rule", "shard_rules"]

# A JSON-able description of one worker's cut of one engine parameter:
#   {"dim": None} whole;
#   {"dim": d, "parts": [[start, size], ...], "rows": R | None}: each packed part (in the engine's packing order)
#   narrowed along `d`, concatenated along `d`, then (vocabulary) zero-padded along `d` to `R`.
ShardRule = dict[str, Any]
_WHOLE: ShardRule = {"dim": None}


def expected_shard(parts: Sequence[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """The tensor a worker holds for one engine parameter, from the full checkpoint tensors it is made of (`parts`:
    one, or the packed parts in the engine's order, e.g. q, k, v).

    Raises:
        ValueError: the rule has a different number of parts than given.
    """
    dim = rule.get("dim")
    if dim is None:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)
    cuts = rule["parts"]
    if len(cuts) != len(parts):
        raise ValueError(f"the shard rule cuts {len(cuts)} part(s), {len(parts)} were given")
    shard = torch.cat([p.narrow(dim, start, size) for p, (start, size) in zip(parts, cuts)], dim=dim)
    rows = rule.get("rows")
    if rows is not None and rows > shard.shape[dim]:
        pad = list(shard.shape)
        pad[dim] = rows - shard.shape[dim]
        shard = torch.cat([shard, shard.new_zeros(pad)], dim=dim)
    return shard.contiguous()


def shard_rule(layer: torch.nn.Module, param: torch.Tensor) -> ShardRule | None:
    """This worker's cut of `param` (a parameter of `layer`), derived from the layer's class and partitioning
    as its weight loader cuts it; None for a partitioned parameter of a layer this module does not know (reported by
    callers as unchecked, never guessed)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    output_dim = getattr(param, "output_dim", None)
    input_dim = getattr(param, "input_dim", None)
    tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if tp_size == 1 or getattr(param, "is_sharded_weight", False) or (output_dim is None and input_dim is None):
        return dict(_WHOLE)
    if isinstance(layer, RowParallelLinear):
        # NOTE: its bias carries `output_dim` too, but the loader cuts only along `input_dim`: the bias is whole.
        if input_dim is None:
            return dict(_WHOLE)
        n = param.shape[input_dim]
        return {"dim": input_dim, "parts": [[tp_rank * n, n]], "rows": None}
    # NOTE: most specific class first: QKV and merged-column layers are column layers too.
    if isinstance(layer, QKVParallelLinear) and output_dim is not None:
        q = layer.num_heads * layer.head_size
        kv = layer.num_kv_heads * layer.head_size
        v = layer.num_kv_heads * layer.v_head_size
        kv_rank = tp_rank // layer.num_kv_head_replicas
        return {"dim": output_dim, "parts": [[tp_rank * q, q], [kv_rank * kv, kv], [kv_rank * v, v]], "rows": None}
    if isinstance(layer, MergedColumnParallelLinear) and output_dim is not None:
        sizes = [size // tp_size for size in layer.output_sizes]
        return {"dim": output_dim, "parts": [[tp_rank * s, s] for s in sizes], "rows": None}
    if isinstance(layer, ColumnParallelLinear) and output_dim is not None:
        n = param.shape[output_dim]
        return {"dim": output_dim, "parts": [[tp_rank * n, n]], "rows": None}
    if isinstance(layer, VocabParallelEmbedding) and output_dim is not None:
        indices = layer.shard_indices
        start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
        return {"dim": output_dim, "parts": [[start, end - start]], "rows": param.shape[output_dim]}
    return None


def shard_rules(model: torch.nn.Module) -> dict[str, ShardRule | None]:
    """Engine parameter name -> this worker's cut of it (`shard_rule`), for every parameter of a vLLM model."""
    rules: dict[str, ShardRule | None] = {}
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            rules[f"{module_name}.{leaf}" if module_name else leaf] = shard_rule(module, param)
    return rules

