"""Make TRL's experimental `AsyncGRPOTrainer` run on CPU processes, for tests, the benchmark and the demo.

Why: TRL 1.16's async trainer is written for GPUs in two places that have nothing to do with weight sync (read from
`trl/experimental/async_grpo/`):
- its attention for packed rollout trees (`tree_fa3`, `packing.tree_attention`) calls FlashAttention-3's
  `flash_attn_varlen_func`, fetched from the Hugging Face hub by the `kernels` package (no hub here, no CUDA);
- `get_peak_flops_per_device` asks `torch.cuda.get_device_name` (raises on a CPU-only torch) for its MFU metric.
The stand-ins below keep TRL's own tree attention (its index gathering, its mask-free interface) and replace only the
kernel, with the same arithmetic in plain torch (causal within each segment, bottom-right aligned as FlashAttention
does for a query shorter than its keys), and report no peak FLOPs (TRL then disables MFU, as for an unknown GPU).
Test-side only: nothing here is imported by the library, and on GPUs neither is needed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["enable_async_grpo_on_cpu", "varlen_causal_attention"]

_ENABLED = False


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
) -> torch.Tensor:
    """`flash_attn_varlen_func`'s arithmetic in torch: `q` (total_q, heads, d), `k`/`v` (total_k, kv_heads, d);
    segment `s` of the queries attends to segment `s` of the keys, causally with the last query on the last key.
    Computed in float32, returned in `q`'s dtype."""
    heads, dim = q.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(starts_q) - 1):
        q_s = q[starts_q[s] : starts_q[s + 1]].float()
        k_s = k[starts_k[s] : starts_k[s + 1]].float()
        v_s = v[starts_k[s] : starts_k[s + 1]].float()
        lq, lk = q_s.shape[0], k_s.shape[0]
        if lq == 0:
            continue
        groups = heads // k_s.shape[1]
        k_s = k_s.repeat_interleave(groups, dim=1)
        v_s = v_s.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k_s) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(lq).unsqueeze(1) + (lk - lq)
        key_pos = torch.arange(lk).unsqueeze(0)
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= key_pos <= query_pos
        if window_size[0] >= 0:
            allowed &= key_pos >= query_pos - window_size[0]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[starts_q[s] : starts_q[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_s).to(q.dtype)
    return out


def enable_async_grpo_on_cpu() -> None:
    """Swap the two GPU-only pieces of TRL's async trainer for CPU stand-ins (idempotent; only where CUDA is
    absent)."""
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    kernel = SimpleNamespace(flash_attn_varlen_func=varlen_causal_attention)
    packing._flash_attn = lambda: kernel  # type: ignore[assignment]

    def no_peak_flops(accelerator: Any, dtype: str) -> None:
        return None

    async_grpo_trainer.get_peak_flops_per_device = no_peak_flops  # type: ignore[assignment]
    _ENABLED = True
