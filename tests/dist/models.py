"""Tiny models for the torch-only distributed tests (built from configs, identical on every rank)."""

from __future__ import annotations

import torch
from torch import nn


def device() -> torch.device:
    """This rank's device: its GPU under NCCL (multi-GPU machines), else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tiny_lm(seed: int = 0, *, tie: bool = True, layers: int = 2, vocab: int = 256) -> nn.Module:
    """A Qwen2-style causal LM with nested decoder layers (the FSDP units) and tied embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device())


def decoder_layer_cls(model: nn.Module) -> type:
    return type(model.model.layers[0])


def full_reference(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights by parameter name (tied weights once), cloned, on the CPU."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 0) -> float:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 8), generator=generator).to(device())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def wrap(model: nn.Module, backend: str, world_size: int, use_orig_params: bool = True) -> nn.Module:
    """`tiny_lm` wrapped as the tests run it: FSDP1 per decoder layer, FSDP2 per layer and root, DDP, or as is."""
    match backend:
        case "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            return FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({decoder_layer_cls(model)}),
                device_id=device() if device().type == "cuda" else torch.device("cpu"),
                use_orig_params=use_orig_params,
            )
        case "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device().type, (world_size,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        case "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model)
        case _:
            return model
