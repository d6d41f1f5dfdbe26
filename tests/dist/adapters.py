"""PEFT models, their sharding and a recording adapter writer for the adapter-sync distributed tests
(tests/dist/test_adapter_sync.py, tests/dist/test_adapter_faults.py): shared here so no test file imports another's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_sync.compat.lora_api import Adapter, EngineLoRA, LoRALimits, lora_model, served_lora_tensors
from fsdp_sync.digest import tensor_digest

from .models import tiny_lm

LIMITS = LoRALimits(8, frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}), torch.float32)


class RecordingAdapterWriter:
    """Keeps every adapter it is given (an `AdapterWriter`)."""

    kind = "record"
    pushes = True
    engine_per_rank = True
    retains_tensors = False
    engine_dtype = torch.float32

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        # every adapter loaded (staged), every name published (what requests name), every staged one dropped
        self.adapters: list[Adapter] = []
        self.published: list[str] = []
        self.abandoned: list[str] = []

    def lora_limits(self) -> LoRALimits:
        return LIMITS

    def adapter_transport_refusal(self) -> str | None:
        return None

    def base_checkpoint(self) -> str:
        return self.checkpoint

    def load_adapter(self, adapter: Adapter) -> None:
        self.adapters.append(Adapter(adapter.adapter_id, adapter.name, {k: v.clone() for k, v in adapter.tensors.items()}, adapter.config))

    def publish_adapter(self, adapter: Adapter) -> None:
        assert self.adapters and self.adapters[-1].name == adapter.name, "published what was not staged last"
        self.published.append(adapter.name)

    def abandon_adapter(self) -> None:
        if self.adapters:
            self.abandoned.append(self.adapters[-1].name)

    def adapter_request(self) -> object | None:
        return self.published[-1] if self.published else None

    def adapter_digests(self) -> tuple[dict[str, dict[str, str]], EngineLoRA]:
        """The adapter staged last as an engine would serve it (vLLM's own `LoRAModel`, float32, no name mapping), built
        from the copy this writer kept: what a test changes in `adapters` shows here."""
        engine = EngineLoRA(torch.float32)
        served = served_lora_tensors(lora_model(self.adapters[-1], engine), {})
        return {"": {key: tensor_digest(t) for key, t in served.items()}}, engine


def full_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's adapter by PEFT checkpoint name, taken independently of the sync (full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.replace(".default", ""): v.detach().cpu().clone() for k, v in state.items() if ".lora_" in k}


def peft_lm(seed: int = 0, **lora: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_lm(seed), LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"], **lora))
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero adapter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return model


def wrap(model: torch.nn.Module, backend: str, world_size: int) -> torch.nn.Module:
    """A PEFT model sharded per decoder layer (the adapters inside their layer's unit), then at the root."""
    layers = model.get_base_model().model.layers
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({type(layers[0])})
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def save_base(directory: str, seed: int) -> None:
    if dist.get_rank() == 0:
        tiny_lm(seed).save_pretrained(directory)
    dist.barrier()
