"""`compat.load_probe`: the model's own loader run dry (fake models whose `load_weights` write as vLLM's loaders do):
which tensors an in-place reload would drop, which land predictably, and that nothing else is touched meanwhile."""

from __future__ import annotations

import threading

import torch

from fsdp_sync.compat.load_probe import probe_loads, reload_gaps
from fsdp_sync.compat.patch_api import PatchTarget, find_patch_targets


def _default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class Model(torch.nn.Module):
    """`w` through its weight loader; `sinks` copied directly (gpt-oss's way); `t` transposed; `b` widened to fp32
    (vLLM-CPU's small-GEMM biases); `qk` fused from two tensors through the weight loader with a shard id."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.t = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32), requires_grad=False)
        self.qk = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
        self.w.weight_loader = _default_loader
        self.qk.weight_loader = lambda p, x, shard: p.data.narrow(0, 0 if shard == "q" else 2, 2).copy_(x)

    def load_weights(self, weights):
        for name, x in weights:
            if name == "sinks":
                self.sinks.data.copy_(x)
            elif name == "t":
                getattr(self.t, "weight_loader", _default_loader)(self.t, x.t())
            elif name in ("q", "k"):
                self.qk.weight_loader(self.qk, x, name)
            else:
                param = getattr(self, name)
                getattr(param, "weight_loader", _default_loader)(param, x)
        return set()


SPECS = {
    "w": ((2, 3), torch.bfloat16),
    "sinks": ((4,), torch.bfloat16),
    "t": ((2, 3), torch.bfloat16),
    "b": ((3,), torch.bfloat16),
    "q": ((2, 2), torch.bfloat16),
    "k": ((2, 2), torch.bfloat16),
}


def _bf16(model: Model) -> Model:
    for name in ("w", "sinks", "t", "qk"):
        getattr(model, name).data = getattr(model, name).data.to(torch.bfloat16)
    return model


def test_the_probe_tells_reload_gaps_and_predictable_landings_and_writes_nothing() -> None:
    model = _bf16(Model())
    landings = probe_loads(model, SPECS)
    assert reload_gaps(landings).keys() == {"sinks"}, "only the direct copy bypasses the weight loaders"
    assert "copies it into sinks directly" in reload_gaps(landings)["sinks"]
    assert {n: l.loaders for n, l in landings.items()} == {
        "w": ["w"], "sinks": [], "t": ["t"], "b": ["b"], "q": ["qk"], "k": ["qk"]
    }  # fmt: skip
    predictable = {n for n, l in landings.items() if l.predictable(torch.bfloat16)}
    assert predictable == {"w", "sinks", "b", "q", "k"}, "t is transposed; b widened exactly is predictable"
    assert landings["k"].copies[0].offset == 4
    assert all(not p.float().any() for p in model.parameters()), "the probe must not write"
    assert model.w.weight_loader is _default_loader and not hasattr(model.sinks, "weight_loader"), "loaders restored"


def test_a_loader_that_cannot_run_dry_leaves_only_its_own_tensor_unknown() -> None:
    model = _bf16(Model())
    landings = probe_loads(model, {**SPECS, "unknown": ((1,), torch.bfloat16)})
    assert landings["unknown"].error is not None and "AttributeError" in landings["unknown"].error
    assert landings["w"].loaders == ["w"] and landings["sinks"].direct == ["sinks"]


class Slow(torch.nn.Module):
    """Its loader waits, mid-load, until another thread has made its own copies (so that they overlap the dry run)."""

    def __init__(self, other_done: threading.Event, started: threading.Event) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        self.other_done, self.started = other_done, started

    def load_weights(self, weights):
        for _, x in weights:
            self.started.set()
            assert self.other_done.wait(30), "the other thread never finished"
            self.w.data.copy_(x)
        return set()


def test_copies_by_other_threads_during_the_dry_run_are_not_intercepted() -> None:
    """Regression: the dry run used to replace `torch.Tensor.copy_` for the whole process while it ran, so a copy
    made by any other thread in that window (a data loader, an engine thread) was silently skipped."""
    other_done, started = threading.Event(), threading.Event()
    model = Slow(other_done, started)
    destination = torch.zeros(1000)
    copied: list[bool] = []

    def other_thread() -> None:
        assert started.wait(30)
        for i in range(20):
            source = torch.full((1000,), float(i + 1))
            destination.copy_(source)
            copied.append(bool(torch.equal(destination, source)))
        other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    targets = find_patch_targets(model, {"w": ((8,), torch.float32)})
    thread.join(30)
    assert copied == [True] * 20, "another thread's copies were swallowed by the dry run"
    assert targets == {"w": PatchTarget("w", 0)} and not model.w.any()


def test_gpt_oss_stacks_and_sinks_are_refused_for_a_server_that_runs_vllms_own_loader() -> None:
    """A server on vLLM's own weight-transfer backend (NCCL) runs gpt-oss's loader unfixed, and its model cannot be
    run dry from the trainer: its sinks and expert stacks are refused by name, nothing else, and no other model."""
    from fsdp_sync.compat.vllm_patches import unfixed_reload_gaps

    layer = "model.layers.3"
    refused = [f"{layer}.self_attn.sinks"] + [
        f"{layer}.mlp.experts.{leaf}" for leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    ]
    kept = [f"{layer}.self_attn.q_proj.weight", f"{layer}.mlp.router.weight", "model.embed_tokens.weight"]
    gaps = unfixed_reload_gaps(["GptOssForCausalLM"], refused + kept)
    assert gaps.keys() == set(refused)
    assert all("weight-transfer-config" in reason for reason in gaps.values())
    assert unfixed_reload_gaps(["LlamaForCausalLM"], refused + kept) == {}
