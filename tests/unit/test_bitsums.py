"""`fsdp_sync.bitsums`: the GPU kernel of the delta check gives the torch reference's fingerprint, bit for bit.

Why: the check proves every sync that skipped weights did not change by comparing fingerprints taken at two
times; the kernel replaces the reference on CUDA, so it must give the same three sums for every size (a partial
last block, a tail past the last full period, several wraps of the period) and detect the same changes.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import bitsums
from fsdp_sync.delta import _PERIOD, _sum_fingerprint, fingerprints

pytestmark = pytest.mark.skipif(not bitsums.available(), reason="needs CUDA and Triton")


@pytest.mark.parametrize("numel", [4, 4096, 8191 * 4, 8191 * 4 + 3, 3 * 8191 * 8191 + 17, 50_000_000])
def test_kernel_sums_equal_the_torch_reference(numel: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(numel)
    tensor = torch.randn(numel, generator=generator, device="cuda").to(torch.bfloat16)
    _, (kernel,) = fingerprints([("w", tensor)])
    assert torch.equal(kernel, _sum_fingerprint(tensor)), (kernel, _sum_fingerprint(tensor))


def test_kernel_detects_one_changed_element_and_a_swap() -> None:
    tensor = torch.randn(8191 * 3 + 11, device="cuda").to(torch.bfloat16)
    one, swapped = tensor.clone(), tensor.clone()
    one[5000] = one[5000] + 1
    swapped[[7, 8191 * 2 + 7]] = tensor[[8191 * 2 + 7, 7]]
    swapped[[100, 101]] = tensor[[101, 100]]
    _, prints = fingerprints([("a", tensor), ("b", tensor.clone()), ("c", one), ("d", swapped)])
    assert torch.equal(prints[0], prints[1])
    assert not torch.equal(prints[0], prints[2]) and not torch.equal(prints[0], prints[3])


def test_many_tensors_share_outputs_and_odd_sizes_fall_back() -> None:
    """More tensors than one output holds, and a tensor whose bytes are not whole int64 words (the reference)."""
    tensors = [torch.randn(1000 + k, device="cuda") for k in range(300)] + [torch.randn(3, device="cuda")]
    names, prints = fingerprints((str(k), t) for k, t in enumerate(tensors))
    assert len(names) == len(prints) == len(tensors)
    for tensor, p in zip(tensors, prints, strict=True):
        assert torch.equal(p, _sum_fingerprint(tensor))
    assert _PERIOD > 4096
