"""Adapter syncs, pure parts: PEFT names to the names vLLM parses, what vLLM cannot serve (refused with the reason),
the rank the engine is started with, and TRL's generate calls made to ask for the adapter."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.compat.lora_api import LoRALimits, adapter_refusals, adapter_tensor_name, peft_adapter_config
from fsdp_sync.compat.trl_adapter import ask_for_adapter, lora_rank_for_engine, peft_rank
from fsdp_sync.config import SyncConfig

LIMITS = LoRALimits(8, frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}), torch.float32)


def test_adapter_tensor_names_drop_the_adapter_name_and_keep_the_peft_root() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert adapter_tensor_name(name, "default") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter_tensor_name(name, "other") is None
    assert adapter_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default") is None
    assert adapter_tensor_name("base_model.model.lm_head.lora_magnitude_vector.default.weight", "default") is None


def _config(**changes: object) -> dict:
    from peft import LoraConfig

    return {**LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"]).to_dict(), **changes}


def test_a_plain_lora_adapter_is_servable() -> None:
    assert adapter_refusals(_config(), LIMITS, {"q_proj", "v_proj"}) == []


@pytest.mark.parametrize(
    ("changes", "targeted", "says"),
    [
        ({"use_dora": True}, {"q_proj"}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, {"q_proj"}, "modules_to_save"),
        ({"r": 16}, {"q_proj"}, "max_lora_rank 8"),
        ({"rank_pattern": {"q_proj": 32}}, {"q_proj"}, "rank 32"),
        ({}, {"q_proj", "conv1d"}, "target modules ['conv1d']"),
        ({"bias": "all"}, {"q_proj"}, "bias"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_with_the_reason(changes: dict, targeted: set, says: str) -> None:
    reasons = adapter_refusals(_config(**changes), LIMITS, targeted)
    assert any(says in r for r in reasons), reasons


def test_the_peft_config_of_a_model_as_a_plain_dict() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    lora = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora)
    name, plain = peft_adapter_config(model)
    assert name == "default" and plain["r"] == 4 and plain["target_modules"] == ["q_proj"]
    assert plain["peft_type"] == "LORA"
    with pytest.raises(ValueError, match="not a PEFT model"):
        peft_adapter_config(AutoModelForCausalLM.from_config(config))


def test_the_engine_rank_is_the_smallest_vllm_accepts() -> None:
    from peft import LoraConfig

    assert lora_rank_for_engine(4) == 8 and lora_rank_for_engine(8) == 8 and lora_rank_for_engine(9) == 16
    assert peft_rank(LoraConfig(r=4, rank_pattern={"v_proj": 12})) == 12
    assert peft_rank(None) is None
    with pytest.raises(ValueError, match="above every max_lora_rank"):
        lora_rank_for_engine(4096)


def test_generation_asks_for_the_current_adapter_where_the_caller_names_none() -> None:
    """What TRL's `VLLMGeneration.generate` calls (`llm.generate(prompts, sampling_params=..., use_tqdm=False)`)
    gets the adapter; a caller's own request is kept; wrapping twice wraps once."""

    class Engine:
        def __init__(self) -> None:
            self.calls: list[object] = []

        def generate(self, prompts: object, sampling_params: object = None, **kwargs: object) -> object:
            self.calls.append(kwargs.get("lora_request"))
            return prompts

    engine = Engine()
    current = ["v1"]
    ask_for_adapter(engine, lambda: current[0])
    ask_for_adapter(engine, lambda: "twice")
    engine.generate(["p"], sampling_params=None, use_tqdm=False)
    current[0] = "v2"
    engine.generate(["p"])
    engine.generate(["p"], lora_request="mine")
    assert engine.calls == ["v1", "v2", "mine"]


def test_adapter_and_sparse_options_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="adapter=True"):
        SyncConfig(adapter=True, sparse=True)
    assert SyncConfig().adapter is None


def test_a_server_reports_its_lora_rank_and_pushed_names_resolve_to_memory() -> None:
    """`/server_info` with a LoRA config gives the rank adapter syncs check against; a pushed adapter's name resolves
    to a request for the in-memory adapter (its path names no file), any other name to nothing."""
    import asyncio

    from fsdp_sync.compat.lora_api import IN_MEMORY_PATH
    from fsdp_sync.compat.lora_patches import InMemoryLoRAResolver
    from fsdp_sync.compat.server_api import parse_server_info

    answer = {"vllm_config": {"model_config": {"model": "/m", "dtype": "float32"}, "lora_config": {"max_lora_rank": 8}}}
    assert parse_server_info(answer).max_lora_rank == 8
    del answer["vllm_config"]["lora_config"]
    assert parse_server_info(answer).max_lora_rank is None
    resolver = InMemoryLoRAResolver()
    request = asyncio.run(resolver.resolve_lora("/m", "fsdp-vllm-sync-v3"))
    assert request.lora_name == "fsdp-vllm-sync-v3" and request.lora_path.startswith(IN_MEMORY_PATH)
    assert asyncio.run(resolver.resolve_lora("/m", "some/other-adapter")) is None


class _AdapterEngine:
    """An `AdapterWriter` whose engine has LoRA (`limits`) or not (None); it records what it is given."""

    kind = "fake"
    pushes = True
    engine_per_rank = True
    retains_tensors = False
    engine_dtype = torch.float32

    def __init__(self, limits: LoRALimits | None) -> None:
        self.limits = limits

    def lora_limits(self) -> LoRALimits | None:
        return self.limits

    def base_checkpoint(self) -> str:
        return "/nonexistent"

    def load_adapter(self, adapter: object) -> None:
        raise AssertionError("nothing is loaded at build time")

    def adapter_request(self) -> object | None:
        return None


def _tiny_peft(**lora: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    adapter = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"], **lora)
    return get_peft_model(AutoModelForCausalLM.from_config(config), adapter)


def test_adapter_syncs_by_default_where_the_engine_serves_the_adapter_else_merged_with_the_reason(caplog) -> None:
    import logging

    from fsdp_sync.assemble import _adapter_sync
    from fsdp_sync.errors import UnsupportedSetupError
    from fsdp_sync.sync.adapter import AdapterSync

    cpu = torch.device("cpu")
    sync = _adapter_sync(_tiny_peft(), _AdapterEngine(LIMITS), SyncConfig(), cpu, None)
    assert isinstance(sync, AdapterSync) and sync.plan is not None
    with caplog.at_level(logging.INFO, logger="fsdp_sync.assemble"):
        assert _adapter_sync(_tiny_peft(), _AdapterEngine(None), SyncConfig(), cpu, None) is None
        assert _adapter_sync(_tiny_peft(use_dora=True), _AdapterEngine(LIMITS), SyncConfig(), cpu, None) is None
    assert "started without LoRA" in caplog.text and "DoRA" in caplog.text
    with pytest.raises(UnsupportedSetupError, match="SyncConfig\\(adapter=False\\)"):
        _adapter_sync(_tiny_peft(use_dora=True), _AdapterEngine(LIMITS), SyncConfig(adapter=True), cpu, None)
