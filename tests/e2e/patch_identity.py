"""Run by `test_engine_patches.py` in a process of its own (one in-process vLLM engine per process).

A real vLLM CPU engine on a tiny Qwen2 checkpoint, its linear weights kept unpacked as `SyncConfig(sparse=True)`
keeps them, takes through `ColocateWriter`: the checkpoint (a complete reload), then new weights for layer 1's
attention (q, k, v: one fused module) as a partial reload, then sparse patches of every other tensor. Every engine
parameter must then equal the new weights bit for bit (the regression: layer 0's fused `qkv_proj.bias`, left out of
the partial reload, kept vLLM's deferring loader and silently dropped its patch), and the first-token logprobs must
equal those after the same weights are pushed whole. The patches are written where the probe found each tensor lands
(`find_patch_targets`); the same round back to the old weights then goes through vLLM's own loader. Prints one JSON
line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

PROMPTS = ("the water is", "one two three", "in the of")


def main(out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from fsdp_sync.compat.vllm_patches import keep_cpu_linear_weights

    keep_cpu_linear_weights()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from fsdp_sync._demo.models import build_tiny_checkpoint, read_checkpoint
    from fsdp_sync.compat.engine_api import engine_handle, engine_naming
    from fsdp_sync.compat.patch_api import EnginePatch
    from fsdp_sync.compat.patch_write import apply_patches
    from fsdp_sync.writers import ColocateWriter

    base_dir = build_tiny_checkpoint(out / "base", "qwen2")
    llm = LLM(model=str(base_dir), max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=64 * 2**20, seed=0)
    model = engine_handle(llm).model
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)

    def logprobs() -> list[dict[int, float]]:
        outs = llm.generate([{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    writer = ColocateWriter(llm)
    dtype = writer.engine_dtype
    old = {n: t.to(dtype) for n, t in read_checkpoint(base_dir).items()}
    writer.write(iter(old.items()))
    generator = torch.Generator().manual_seed(1)
    new = {n: (t.float() + torch.randn(t.shape, generator=generator) * 0.01).to(dtype) for n, t in old.items()}
    whole = [n for n in old if n.startswith("model.layers.1.self_attn.") and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    writer.write(iter((n, new[n]) for n in whole))
    patches = []
    for n in old:
        if n in whole:
            continue
        changed = torch.nonzero(new[n].reshape(-1).view(torch.int16) != old[n].reshape(-1).view(torch.int16)).reshape(-1)
        patches.append(EnginePatch(n, tuple(old[n].shape), dtype, changed, new[n].reshape(-1)[changed]))
    writer.write_patches(patches)
    patched_logprobs = logprobs()

    naming = engine_naming(model)
    parts: dict[str, list[tuple[int, str]]] = {}
    for n in new:
        param, index, _ = naming.parameter(n)
        parts.setdefault(param, []).append((index, n))

    def differing(expected_weights: dict[str, torch.Tensor]) -> list[str]:
        engine = dict(model.named_parameters())
        differs = []
        for param, names in parts.items():
            expected = torch.cat([expected_weights[n].reshape(-1) for _, n in sorted(names)])
            if param not in engine or not torch.equal(engine[param].reshape(-1), expected):
                differs.append(param)
        return differs

    differs = differing(new)
    direct = len(writer._patcher.targets)
    writer.write(iter(new.items()))  # the same weights, whole: every layer reloaded and repacked
    whole_logprobs = logprobs()
    # Again through vLLM's own patch loader (no direct targets): back to the old weights.
    writer.write(iter((n, old[n]) for n in whole))
    back = [EnginePatch(p.name, p.shape, p.dtype, p.indices, old[p.name].reshape(-1)[p.indices]) for p in patches]
    apply_patches(model, back, naming, targets={})
    differs_vllm_loader = differing(old)
    print(
        json.dumps(
            {
                "whole": whole,
                "patched": len(patches),
                "differs": differs,
                "direct": direct,
                "differs_vllm_loader": differs_vllm_loader,
                "compared": sorted(parts),
                "logprobs_equal_whole": patched_logprobs == whole_logprobs,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
