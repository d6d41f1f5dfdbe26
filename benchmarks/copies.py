"""Copies of a weight stream into fixed destinations: per tensor, batched, or a replayed CUDA graph.

Why: the engine-layout buffers (`buffers.py`) are filled the way vLLM's loaders fill an engine, one `copy_` per
tensor; on one H200 that loop, not the bytes, bounded a complete sync at 1.5B shapes (338 tensors at 20-35 us of
host work each against a 1.5 ms flat-copy floor; benchmarks/results/gpu.md). An engine that takes its weights in
place can instead issue one `torch._foreach_copy_` per pair of dtypes (one multi-tensor launch on CUDA; the
destinations are grouped once, when the plan is made), or replay a CUDA graph of the whole copy program when every
address is the one it was captured with. The modes run side by side in the GPU benchmark (`gpu.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["COPY_MODES", "CopyPlan"]

COPY_MODES = ("loop", "batched", "graph")


class CopyPlan:
    """Copies of named tensors into fixed destinations, made once per plan and reused by every sync.

    Args:
        destinations: where each name's tensor is copied (same shape; its dtype is the engine's).
        mode: `loop` (one `copy_` per tensor, as vLLM's loaders), `batched` (one `torch._foreach_copy_` per dtype pair
            once `flush_bytes` of sources are pending, and at the end), or `graph` (as `batched`, and once two syncs
            in a row copied the same sources into the same destinations, a CUDA graph of that program replayed for
            as long as they stay: sources are then held until the end of the sync, so only for sources that outlive
            it, e.g. the parameters themselves at world size 1). NOTE: a replay starts once the whole stream is in
            (only then is its key known), so the device waits for all of the host's work first; it can win only
            where that work is small against the copies' launches it saves.
        flush_bytes: the bound on pending source bytes in `batched` mode (they are kept alive until copied).
            NOTE: 256 MiB, not the whole stream: the device copies the first batch while the host still takes the
            next tensors (a launch per dtype pair per batch; about a dozen batches at 1.5B).
        alone_bytes: in `batched` mode, a tensor at least this large is copied at once with its own `copy_`.
            NOTE: measured on one H100 (benchmarks/results/gpu.md, December 5, 2026): with every tensor batched, a
            7B sync (339 tensors, 15.2 GB) took 14.6 ms against 12.1 ms one `copy_` at a time: the multi-tensor
            kernel copies large tensors slower than a plain copy does, and a launch is nothing against their bytes.
    """

    def __init__(
        self,
        destinations: Mapping[str, torch.Tensor],
        *,
        mode: str = "batched",
        flush_bytes: int = 2**28,
        alone_bytes: int = 2**24,
    ) -> None:
        if mode not in COPY_MODES:
            raise ValueError(f"copy mode {mode!r}; valid: {', '.join(COPY_MODES)}")
        self.destinations = dict(destinations)
        self.mode = mode
        self.flush_bytes = flush_bytes
        self.alone_bytes = alone_bytes
        self._graph: torch.cuda.CUDAGraph | None = None
        # Per copy: source address, destination address, elements, source dtype.
        self._graph_key: tuple[tuple[int, int, int, torch.dtype], ...] | None = None
        self._last_key: tuple[tuple[int, int, int, torch.dtype], ...] | None = None
        self.replays = 0  # syncs served by the graph (for tests and the benchmark's rows)

    @torch.no_grad()
    def copy(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every `(name, tensor)` into its destination; all copies are issued when this returns."""
        if self.mode == "loop":
            destinations = self.destinations
            for name, tensor in weights:
                destinations[name].copy_(tensor)
            return
        pending: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        pending_bytes = 0
        graphed = self.mode == "graph"
        key: list[tuple[int, int, int, torch.dtype]] = []
        destinations = self.destinations
        alone_bytes = self.alone_bytes
        for name, tensor in weights:
            destination = destinations[name]
            nbytes = tensor.numel() * tensor.element_size()
            if not graphed and nbytes >= alone_bytes:
                destination.copy_(tensor)
                continue
            pair = (tensor.dtype, destination.dtype)
            lists = pending.get(pair)
            if lists is None:
                lists = pending[pair] = ([], [])
            lists[0].append(destination)
            lists[1].append(tensor)
            if graphed:
                key.append((tensor.data_ptr(), destination.data_ptr(), tensor.numel(), tensor.dtype))
            else:
                pending_bytes += nbytes
                if pending_bytes >= self.flush_bytes:
                    _issue(pending)
                    pending_bytes = 0
        now = tuple(key)
        if graphed and self._graph is not None and now == self._graph_key:
            self._graph.replay()
            self.replays += 1
            return
        program = {pair: (list(dsts), list(srcs)) for pair, (dsts, srcs) in pending.items()} if graphed else {}
        _issue(pending)
        if graphed:
            if now == self._last_key and torch.cuda.is_available() and program:
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph):  # captured, not run: this sync copied already
                    _issue(program)
                self._graph_key = now
            self._last_key = now


def _issue(pending: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
    """One `torch._foreach_copy_` per dtype pair (same dtypes throughout a list: the multi-tensor fast path)."""
    for dsts, srcs in pending.values():
        torch._foreach_copy_(dsts, srcs)
    pending.clear()
