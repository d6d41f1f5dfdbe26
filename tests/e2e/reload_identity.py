"""Run by `test_engine_reload.py` in a process of its own (one in-process vLLM engine per process).

Starts a real vLLM CPU engine on a tiny checkpoint as TRL's colocate mode does (weights packed away, as in
production), then pushes through `ColocateWriter`: (1) the unchanged checkpoint: every engine parameter and buffer
must equal the fresh load's bit for bit and the first-token logprobs must be identical; (2) a perturbed checkpoint:
the engine's logprobs must match the Hugging Face model of those weights; (3) the unchanged checkpoint again: back to
the fresh load exactly. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

PROMPTS = ("the water is", "one two three", "in the of")


def main(family: str, out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from fsdp_sync.compat.engine_api import engine_handle
    from fsdp_sync._demo.models import build_tiny_checkpoint, read_checkpoint
    from fsdp_sync.writers import ColocateWriter

    base_dir = build_tiny_checkpoint(out / "base", family)
    llm = LLM(model=str(base_dir), max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=64 * 2**20, seed=0)
    model = engine_handle(llm).model
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)

    def state() -> dict[str, torch.Tensor]:
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        return {name: t.detach().clone() for name, t in tensors.items()}

    def logprobs() -> list[dict[int, float]]:
        outs = llm.generate([{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    def differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
        return [n for n, t in expected.items() if n not in got or not torch.equal(t, got[n])]

    writer = ColocateWriter(llm)
    fresh_state, fresh_logprobs = state(), logprobs()
    checkpoint = read_checkpoint(base_dir)
    writer.write(iter(checkpoint.items()))
    unchanged_state, unchanged_logprobs = state(), logprobs()

    generator = torch.Generator().manual_seed(1)
    perturbed = {n: t + torch.randn(t.shape, generator=generator) * t.std() for n, t in checkpoint.items()}
    perturbed_dir = out / "perturbed"
    shutil.copytree(base_dir, perturbed_dir)
    save_file(perturbed, str(perturbed_dir / "model.safetensors"))
    writer.write(iter(perturbed.items()))
    reference = AutoModelForCausalLM.from_pretrained(str(perturbed_dir), dtype=torch.float32)
    reference = reference.to(engine_handle(llm).dtype)
    worst = 0.0
    for prompt, engine in zip(PROMPTS, logprobs()):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        worst = max(worst, *(abs(lp - expected[t].item()) for t, lp in engine.items()))

    writer.write(iter(checkpoint.items()))
    back_state, back_logprobs = state(), logprobs()
    print(
        json.dumps(
            {
                "compared": sorted(fresh_state),
                "unchanged_differs": differences(fresh_state, unchanged_state),
                "unchanged_logprobs_equal": unchanged_logprobs == fresh_logprobs,
                "perturbed_worst_logprob_error": worst,
                "back_differs": differences(fresh_state, back_state),
                "back_logprobs_equal": back_logprobs == fresh_logprobs,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
