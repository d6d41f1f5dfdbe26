"""`compat.patch_api`: where the probe finds each checkpoint tensor lands (fake models whose `load_weights` copy as
vLLM's loaders do), and the direct indexed write of patches there."""

from __future__ import annotations

import torch

from fsdp_sync.compat.engine_api import EngineNaming
from fsdp_sync.compat.patch_api import EnginePatch, PatchTarget, find_patch_targets
from fsdp_sync.compat.patch_write import apply_patches


class Fused(torch.nn.Module):
    """q and k fused along dim 0 (as `qkv_proj`), a norm copied whole, and `t` loaded transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.t = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.writes = 0

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k"):
                self.qk.data.narrow(0, 0 if name == "q" else 2, w.shape[0]).copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "t":
                self.t.data.copy_(w.t())
            else:
                raise KeyError(name)
        return {n for n, _ in weights}


def test_the_probe_finds_contiguous_landings_and_writes_nothing() -> None:
    model = Fused()
    specs = {"q": ((2, 4), torch.float32), "k": ((4, 4), torch.float32), "norm": ((4,), torch.float32),
             "t": ((3, 4), torch.float32), "missing": ((1,), torch.float32)}  # fmt: skip
    targets = find_patch_targets(model, specs)
    assert targets == {"q": PatchTarget("qk", 0), "k": PatchTarget("qk", 8), "norm": PatchTarget("norm", 0)}
    assert all(not p.any() for p in model.parameters()), "the probe must not write"


def test_direct_and_loader_patches_land_exactly() -> None:
    model = Fused()
    k = torch.arange(16, dtype=torch.float32).view(4, 4) + 1
    patches = [EnginePatch("k", (4, 4), torch.float32, torch.tensor([0, 5, 15]), k.view(-1)[[0, 5, 15]])]
    written = apply_patches(model, patches, EngineNaming(), targets={"k": PatchTarget("qk", 8)})
    assert written == ["qk"]
    expected = torch.zeros(6, 4)
    expected.view(-1)[8 + torch.tensor([0, 5, 15])] = k.view(-1)[[0, 5, 15]]
    assert torch.equal(model.qk, expected)
