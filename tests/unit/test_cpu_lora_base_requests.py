"""`compat.cpu_lora_base_requests`: vLLM-CPU's LoRA wrapper, run on a batch mixing tokens with and without an adapter,
leaves the tokens without one alone once patched (no engine: `PunicaWrapperCPU` itself, as a LoRA layer calls it).
The engine-level regression is `tests/e2e/test_cpu_lora_base_requests.py`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fsdp_sync.compat import cpu_lora_base_requests as patch

# Token -> adapter id (0: none), as vLLM maps a batch of 3 requests: base, adapter, base.
MIXED = (0, 0, 0, 1, 1, 0, 0)


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's own ops in every module that holds them, whatever an earlier test or plugin installed; put back as they
    were after the test."""
    punica_cpu = patch._cpu_punica()
    if punica_cpu is None:
        pytest.skip("no vLLM CPU LoRA wrapper here")
    for module in patch._namespaces(punica_cpu):
        for name in patch._SLOT_OPS:
            op = getattr(module, name, None)
            if op is not None:
                original = op.__wrapped__ if getattr(op, patch._MARK, False) else op
                monkeypatch.setattr(module, name, original)
    yield


def _through_the_wrapper(token_ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """What `PunicaWrapperCPU` adds for a one-slot adapter (id 1 in slot 0): to a linear layer's output (prefill: the
    `sgmv` ops) and to the logits (the `bgmv` ops), each starting from zeros."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    generator = torch.Generator().manual_seed(0)
    n, d_in, rank, d_out, vocab = len(token_ids), 8, 4, 6, 16
    wrapper = PunicaWrapperCPU(64, 8, "cpu")
    wrapper.update_metadata(LoRAMapping(token_ids, token_ids, is_prefill=True), [1], 1, vocab)
    x = torch.randn(n, d_in, generator=generator)
    linear = torch.zeros(n, d_out)
    a, b = torch.randn(1, 1, rank, d_in, generator=generator), torch.randn(1, 1, d_out, rank, generator=generator)
    wrapper.add_lora_linear(linear, x, (a,), (b,), 1.0, (d_out,))
    logits = torch.zeros(n, vocab)
    logits_a = torch.randn(1, 1, rank, d_in, generator=generator)
    logits_b = torch.randn(1, 1, vocab, rank, generator=generator)
    wrapper.add_lora_logits(logits, x, logits_a, logits_b, 1.0)
    return {"linear": linear, "logits": logits}


def test_tokens_without_an_adapter_get_the_last_slot_until_patched(unpatched: None) -> None:
    """Regression (issue 49): the unpatched ops add the adapter (slot -1, the last) to every row of a base request
    batched with an adapter request; patched, those rows stay as they were and the adapter rows are the same bits."""
    base = torch.tensor([i == 0 for i in MIXED])
    assert patch.lora_ops_apply_unset_slots(), "vLLM 0.32's CPU ops have the defect"
    before = _through_the_wrapper(MIXED)
    for name, out in before.items():
        assert out[base].abs().amax() > 0.1, f"{name}: the defect, as measured on vLLM-CPU 0.32"
    alone = _through_the_wrapper((0,) * len(MIXED))  # no token with an adapter: vLLM skips the ops (`no_lora`)
    assert alone["linear"].abs().amax() == 0

    assert patch.skip_lora_for_base_requests()
    assert not patch.lora_ops_apply_unset_slots()
    after = _through_the_wrapper(MIXED)
    for name, out in after.items():
        assert torch.equal(out[base], torch.zeros_like(out[base])), f"{name}: base rows untouched"
        assert torch.equal(out[~base], before[name][~base]), f"{name}: adapter rows as before, bit for bit"
    everything = _through_the_wrapper((1,) * len(MIXED))
    assert everything["linear"].abs().amax() > 0.1


def test_patching_twice_changes_nothing_more(unpatched: None) -> None:
    punica_cpu = patch._cpu_punica()
    assert patch.skip_lora_for_base_requests()
    first = {name: getattr(punica_cpu, name) for name in patch._SLOT_OPS}
    assert patch.skip_lora_for_base_requests()
    assert {name: getattr(punica_cpu, name) for name in patch._SLOT_OPS} == first
    defining = patch._namespaces(punica_cpu)[1]
    assert all(getattr(defining, name) is first[name] for name in patch._SLOT_OPS), "the sgmv ops call the fix too"


def _fixed_upstream(op: Callable[..., Any]) -> Callable[..., Any]:
    """An op as a fixed vLLM might have it: rows of index -1 skipped (not this package's wrapper)."""

    @functools.wraps(op)
    def fixed(inputs: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, idx: torch.Tensor, *rest: Any) -> None:
        keep = out[idx < 0].clone()
        op(inputs, weights, out, idx.clamp_min(0), *rest)
        out[idx < 0] = keep

    return fixed


def test_a_vllm_without_the_defect_or_another_platform_is_left_alone(
    unpatched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by what the ops do, not by version: ops that skip index -1 are not wrapped; off the CPU platform the
    patch does nothing at all."""
    from vllm.platforms import current_platform

    punica_cpu = patch._cpu_punica()
    namespaces = patch._namespaces(punica_cpu)
    for name in patch._SLOT_OPS:
        fixed = _fixed_upstream(getattr(punica_cpu, name))
        for module in namespaces:
            monkeypatch.setattr(module, name, fixed)
    ops = {name: getattr(punica_cpu, name) for name in patch._SLOT_OPS}
    assert not patch.lora_ops_apply_unset_slots()
    assert not patch.skip_lora_for_base_requests()
    assert {name: getattr(punica_cpu, name) for name in patch._SLOT_OPS} == ops

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert patch._cpu_punica() is None
    assert not patch.lora_ops_apply_unset_slots() and not patch.skip_lora_for_base_requests()


def test_this_packages_vllm_plugin_installs_it(unpatched: None) -> None:
    """Every vLLM process where the package is installed runs its plugin (`fsdp_sync.transfer.plugin.register`):
    a server's workers and a colocated engine get the ops that leave base-model tokens alone."""
    from fsdp_sync.transfer.plugin import register

    punica_cpu = patch._cpu_punica()
    assert punica_cpu is not None and patch.lora_ops_apply_unset_slots()
    register()
    assert all(getattr(getattr(punica_cpu, name), patch._MARK, False) for name in patch._SLOT_OPS)
    assert not patch.lora_ops_apply_unset_slots()
