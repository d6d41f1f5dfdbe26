"""`fsdp_sync.bitsums`: the GPU kernel of the delta check gives the torch reference's fingerprint, bit for bit.

Why: the check proves every sync that skipped weights did not change by comparing fingerprints taken at two
times; the kernel replaces the reference on CUDA, so it must give the same three sums for every size (a partial
last block, a tail past the last full period, several wraps of the period) and detect the same changes. Without a
GPU the same kernel runs on CPU tensors under Triton's interpreter (small sizes: it is slow; conftest.py); with
one, on CUDA (sizes up to 50M elements as well).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import bitsums
from fsdp_sync.compat.engine_api import EngineNaming
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
from fsdp_sync.sync.delta import DeltaTracker, EngineGroups
from fsdp_sync.sync.fingerprint import _PERIOD, _fingerprint, _sum_fingerprint, fingerprints
from .support import CUDA, needs_kernels

pytestmark = needs_kernels

SIZES = [4, 4096, 8191 * 4, 8191 * 4 + 3, 8191 * 8 + 36]  # words: 1, 1024, P, (not whole words), 2P + 9
CUDA_SIZES = [3 * 8191 * 8191 + 17, 50_000_000]


def _expected(tensor: torch.Tensor) -> torch.Tensor:
    """The reference: the sums where the kernel reads the tensor (whole int64 words), else the per-tensor path."""
    return _sum_fingerprint(tensor) if bitsums.words(tensor) is not None else _fingerprint(tensor)


@pytest.mark.parametrize("numel", SIZES + (CUDA_SIZES if CUDA else []))
def test_kernel_sums_equal_the_torch_reference(numel: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(numel)
    tensor = torch.randn(numel, generator=generator, device=device).to(torch.bfloat16)
    _, (kernel,) = fingerprints([("w", tensor)])
    assert torch.equal(kernel, _expected(tensor)), (kernel, _expected(tensor))


def test_kernel_detects_one_changed_element_and_a_swap(device: torch.device) -> None:
    tensor = torch.randn(8191 * 3 + 11, device=device).to(torch.bfloat16)
    assert bitsums.words(tensor) is not None, "read by the kernel"
    one, swapped = tensor.clone(), tensor.clone()
    one[5000] = one[5000] + 1
    swapped[[7, 8191 * 2 + 7]] = tensor[[8191 * 2 + 7, 7]]
    swapped[[100, 101]] = tensor[[101, 100]]
    _, prints = fingerprints([("a", tensor), ("b", tensor.clone()), ("c", one), ("d", swapped)])
    assert torch.equal(prints[0], prints[1])
    assert not torch.equal(prints[0], prints[2]) and not torch.equal(prints[0], prints[3])


def test_many_tensors_in_one_launch_and_odd_sizes_fall_back(device: torch.device) -> None:
    """Tensors of whole words and others (not whole words, an unaligned view) in one call: each row is the
    reference's, in order."""
    tensors = [torch.randn(1000 + 4 * k, device=device) for k in range(40)] + [torch.randn(3, device=device)]
    tensors.append(torch.randn(65, device=device)[1:])  # 4-byte aligned only
    names, prints = fingerprints((str(k), t) for k, t in enumerate(tensors))
    assert names == [str(k) for k in range(len(tensors))] and prints.shape == (len(tensors), 3)
    for tensor, p in zip(tensors, prints, strict=True):
        assert torch.equal(p, _expected(tensor))
    assert _PERIOD > 4096


def test_the_launch_table_is_kept_and_rebuilt_when_an_address_changes(device: torch.device) -> None:
    """The second call over the same tensors reuses the table; new addresses (a tensor replaced) rebuild it, and the
    sums follow the tensors, not the table."""
    sums = bitsums.BitSums(_PERIOD)
    a, b = torch.randn(4096, device=device), torch.randn(8192, device=device)

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        return sums([t.data_ptr() for t in tensors], [bitsums.words(t) for t in tensors], device)  # type: ignore[misc]

    first = call(a, b)
    table = sums._table._table
    again = call(a, b)
    assert sums._table._table is table and torch.equal(first, again)
    c = b.clone()
    c[7] += 1
    changed = call(a, c)
    assert sums._table._table is not table
    assert torch.equal(changed[0], first[0]) and not torch.equal(changed[1], first[1])
    assert torch.equal(changed[1], _sum_fingerprint(c))


def test_the_tracker_finds_the_changed_skipped_weights_through_the_kernel(device: torch.device) -> None:
    """The delta check end to end on the kernel's path: record, then `changed` names exactly the weights written
    since (compared on the device, one read-back), and a partial record updates only those it names."""
    weights = {f"m{k}.weight": torch.randn(2048 + 8 * k, device=device).to(torch.bfloat16) for k in range(6)}
    planned = [PlannedTensor(n, TensorSpec(tuple(w.shape), w.dtype), (n,)) for n, w in weights.items()]
    tracker = DeltaTracker(planned, frozenset(), frozenset(), EngineGroups(EngineNaming({}), None))
    assert tracker.watched == tuple(sorted(weights))
    tracker.record(weights.items())
    assert tracker.changed(weights.items()) == []
    weights["m2.weight"][17] += 1
    weights["m5.weight"][[0, 1]] = weights["m5.weight"][[1, 0]] + 0.5
    assert tracker.changed(weights.items()) == ["m2.weight", "m5.weight"]
    assert tracker.changed(reversed(weights.items())) == ["m5.weight", "m2.weight"], "any order of the shards"
    tracker.record([("m2.weight", weights["m2.weight"])], only=["m2.weight"])
    assert tracker.changed(weights.items()) == ["m5.weight"]
