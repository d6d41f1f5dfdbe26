"""Gathering a selection (delta syncs): every gatherer yields exactly the selected parameters, equal to the unsharded
model's, gathers no unit that holds none of them, and reports `requires_grad` as it is; 2 gloo ranks, real FSDP1
(flat parameters and original parameters) and FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.backend import detect_backend
from fsdp_sync.config import SyncConfig
from fsdp_sync.gather import make_gatherer
from fsdp_sync.memory import MemoryMeter
from tests.support.dist import run_distributed

from .models import full_reference, tiny_lm, wrap


def select_scenario(rank: int, world_size: int, backend: str, strategy: str, use_orig_params: bool) -> dict:
    model = tiny_lm()
    reference = full_reference(model)
    wrapped = wrap(model, backend, world_size, use_orig_params=use_orig_params)
    config = SyncConfig(fsdp1_strategy=strategy) if backend == "fsdp1" else SyncConfig(fsdp2_strategy=strategy)
    gatherer = make_gatherer(wrapped, detect_backend(wrapped), config)
    names = list(gatherer.specs())
    clean = {n: n.replace("_fsdp_wrapped_module.", "") for n in names}
    wanted = frozenset(n for n in names if ".layers.1.self_attn." in clean[n])
    calls = {"n": 0}
    original = dist.all_gather_into_tensor

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        got = {n: t.to("cpu", copy=True) for n, t in gatherer.iter_full(MemoryMeter(torch.device("cpu")), wanted)}
        selected_calls = calls["n"]
        calls["n"] = 0
        every = {n for n, _ in gatherer.iter_full(MemoryMeter(torch.device("cpu")))}
        all_calls = calls["n"]
    finally:
        dist.all_gather_into_tensor = original
    frozen = [p for n, p in wrapped.named_parameters() if ".layers.0." in n]
    for p in frozen:
        p.requires_grad_(False)
    trainable = gatherer.trainable()
    return {
        "yielded": sorted(got),
        "wanted": sorted(wanted),
        "equal": all(torch.equal(t, reference[clean[n]]) for n, t in got.items()),
        "every": len(every) == len(names),
        "calls": (selected_calls, all_calls),
        "layer0_frozen": not any(".layers.0." in clean[n] for n in trainable)
        and any(".layers.1." in clean[n] for n in trainable),
    }


@pytest.mark.parametrize(
    "backend,strategy,use_orig_params",
    [("fsdp1", "flat", True), ("fsdp1", "flat", False), ("fsdp1", "unit", True), ("fsdp2", "flat", True),
     ("fsdp2", "unit", True), ("fsdp2", "param", True)],  # fmt: skip
)
def test_a_selection_gathers_only_what_it_names(backend: str, strategy: str, use_orig_params: bool) -> None:
    for r in run_distributed(select_scenario, backend, strategy, use_orig_params):
        assert r["yielded"] == r["wanted"] and r["wanted"], r
        assert r["equal"], "selected tensors must equal the unsharded model's"
        assert r["every"]
        selected, every = r["calls"]
        if strategy == "flat":  # the flat gatherers run the all-gathers themselves: fewer for a selection
            assert 0 < selected < every, r["calls"]
        # With flat parameters (use_orig_params=False) the unit's flat parameter carries the flag for all of it.
        assert r["layer0_frozen"], "trainable() must follow requires_grad"
