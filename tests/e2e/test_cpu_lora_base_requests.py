"""vLLM-CPU with LoRA: a base-model request batched with an adapter request is answered as the base model.

Regression (issue 49): on vLLM-CPU 0.32 a request without an adapter that shares a batch with an adapter request got
the adapter applied (its tokens carry LoRA index -1, which the CPU LoRA ops took as a slot: the last one). This file is
also the script the test runs in a process of its own (one in-process vLLM engine per process, and vLLM's plugins
off, this package's included, so the engine is vLLM alone until the script applies
`fsdp_sync.compat.cpu_lora_base_requests` itself). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BASE_PROMPTS = ("the water is", "one two three")
ADAPTER_PROMPT = "in the of"
# Equal logprobs: the same arithmetic gives the same bits here; a batch of other shapes may round differently.
EQUAL = 1e-5


def test_a_base_request_batched_with_an_adapter_request_gets_the_base_model(tmp_path: Path) -> None:
    """First-token logprobs of base requests alone equal those of the same requests in one `generate` call with an
    adapter request, in either order; the adapter request is answered with its adapter. Before the patch, where the
    installed vLLM has the defect (found by the patch's own probe), the batched base requests differ."""
    from .helpers import run_engine_script

    result = run_engine_script(Path(__file__), str(tmp_path), timeout=300)
    assert result["adapter_effect"] > 0.05, "the adapter must change the answer for the check to mean anything"
    if result["defective"]:
        assert result["unpatched"] > 100 * EQUAL, "the probe found the defect, so the batched base requests differ"
        assert result["installed"]
    else:
        assert not result["installed"], "a vLLM without the defect is left as it is"
    assert result["patched"] <= EQUAL, f"base requests batched with an adapter request: {result}"
    assert result["patched_adapter"] <= EQUAL, "the adapter request keeps its adapter"
    assert not result["defective_after"]


def _first_token_logprobs(outputs: list) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]


def _difference(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest logprob difference over both top-k sets (a token in one set only counts as the whole gap to the
    other's lowest logprob)."""
    floor_a, floor_b = min(a.values()), min(b.values())
    return max(abs(a.get(t, floor_a) - b.get(t, floor_b)) for t in {*a, *b})


def main(out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = ""  # vLLM alone: no plugin (this package's would install the patch at start)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from fsdp_sync._demo.models import build_tiny_checkpoint

    base_dir = build_tiny_checkpoint(out / "base", "qwen2")
    torch.manual_seed(1)
    # NOTE: init_lora_weights=False: random lora_B too (PEFT's default starts it at zero: no effect to see).
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir)), lora).save_pretrained(str(out / "adapter"))
    adapter = LoRARequest("adapter", 1, str(out / "adapter"))

    llm = LLM(
        model=str(base_dir), dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
        kv_cache_memory_bytes=32 * 2**20, enable_lora=True, max_lora_rank=8, max_loras=1,
        enable_prefix_caching=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)

    def answers(prompts: list[str], requests: list[LoRARequest | None]) -> list[dict[int, float]]:
        return _first_token_logprobs(llm.generate(prompts, params, lora_request=requests, use_tqdm=False))

    base_alone = answers(list(BASE_PROMPTS), [None] * len(BASE_PROMPTS))
    adapter_alone = answers([ADAPTER_PROMPT], [adapter])[0]
    base_as_adapter = answers(list(BASE_PROMPTS), [adapter] * len(BASE_PROMPTS))

    def batched() -> tuple[float, float]:
        """(largest difference of the base requests from alone, of the adapter request from alone), over both
        orders: base requests first, then the adapter request first."""
        base_first = answers([*BASE_PROMPTS, ADAPTER_PROMPT], [None, None, adapter])
        adapter_first = answers([ADAPTER_PROMPT, *BASE_PROMPTS], [adapter, None, None])
        base_diff = max(
            _difference(alone, mixed)
            for alone, mixed in zip(base_alone * 2, [*base_first[:2], *adapter_first[1:]], strict=True)
        )
        adapter_diff = max(_difference(adapter_alone, base_first[2]), _difference(adapter_alone, adapter_first[0]))
        return base_diff, adapter_diff

    from fsdp_sync.compat import cpu_lora_base_requests as patch

    defective = patch.lora_ops_apply_unset_slots()
    unpatched, unpatched_adapter = batched()
    installed = patch.skip_lora_for_base_requests()
    patched, patched_adapter = batched()
    print(json.dumps({
        "adapter_effect": max(_difference(a, b) for a, b in zip(base_alone, base_as_adapter, strict=True)),
        "defective": defective,
        "unpatched": unpatched,
        "unpatched_adapter": unpatched_adapter,
        "installed": installed,
        "patched": patched,
        "patched_adapter": patched_adapter,
        "defective_after": patch.lora_ops_apply_unset_slots(),
    }))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
