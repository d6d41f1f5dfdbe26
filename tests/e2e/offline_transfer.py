"""Run by `test_offline_transfer.py` in a process of its own (one in-process vLLM engine per process).

vLLM's own offline weight-transfer contract, driven against this package's gloo backend: an in-process
`LLM(..., weight_transfer_config=WeightTransferConfig(backend="gloo"))` on a tiny tied-embedding Qwen2, and the
trainer engine from vLLM's `WeightTransferTrainerFactory` over vLLM's `ModuleSource` of a Hugging Face model. (1) the
tied embedding given random values in place, sent: the engine's embedding equals the trainer's bit for bit and its
first-token logprobs equal the Hugging Face model's; (2) the same weights sent again: nothing moves; (3) the
trainer's tie broken (the embedding assigned a new parameter, so the source sends a stale `lm_head.weight` beside it):
the update is refused, naming both; (4) tied again, sent: the engine holds the new embedding. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = ("the water is", "one two three", "in the of")


def main(out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync.compat.engine_api import engine_handle
    from fsdp_sync.distributed import free_port
    from fsdp_sync.transfer.gloo import GlooTrainerInitInfo

    model_dir = build_tiny_checkpoint(out / "model", "qwen2")  # tie_word_embeddings=True
    llm = LLM(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
        kv_cache_memory_bytes=32 * 2**20, weight_transfer_config=WeightTransferConfig(backend="gloo"),
    )  # fmt: skip

    class OfflineClient:
        """vLLM's weight-sync client protocol over the offline `LLM`'s own weight-transfer methods."""

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            llm.init_weight_transfer_engine({"init_info": init_info})

        def start_weight_update(self) -> None:
            llm.start_weight_update()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            llm.update_weights({"update_info": update_info})

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            llm.finish_weight_update(weight_version)

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0), client=OfflineClient(), source=ModuleSource(hf)
    )
    engine_model = engine_handle(llm).model
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def send() -> str | None:
        try:
            trainer.send_weights()
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"
        llm.reset_prefix_cache()
        return None

    def engine_embedding() -> torch.Tensor:
        return engine_model.model.embed_tokens.weight.detach().clone()

    def engine_logprobs() -> list[dict[int, float]]:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    def worst_against_hf(logprobs: list[dict[int, float]]) -> float:
        """The largest gap between the engine's top logprobs and the trainer's model's, over the prompts."""
        worst = 0.0
        for ids, engine in zip(prompts, logprobs):
            with torch.no_grad():
                expected = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            worst = max(worst, *(abs(lp - expected[t].item()) for t, lp in engine.items()))
        return worst

    def moved(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
        """The largest change of a top logprob between two reads (a token new to the top counts its whole gap to
        the lowest logprob the other read kept)."""
        return max(abs(x[t] - y.get(t, min(y.values()))) for x, y in zip(a, b) for t in x)

    fresh = engine_logprobs()
    generator = torch.Generator().manual_seed(1)
    embedding = hf.model.embed_tokens.weight
    with torch.no_grad():  # (1) random values, in place: the tie holds
        embedding.copy_(torch.randn(embedding.shape, generator=generator) * embedding.std())
    random_error = send()
    random_logprobs = engine_logprobs()
    random_worst = worst_against_hf(random_logprobs)
    after_random = engine_embedding()
    sent_random = embedding.detach().clone()
    again_error = send()  # (2) the same weights again
    again_logprobs = engine_logprobs()
    after_again = engine_embedding()

    # (3) the tie broken: a new parameter for the embedding; `lm_head.weight` keeps the previous values
    untied = torch.randn(embedding.shape, generator=generator) * embedding.std()
    hf.model.embed_tokens.weight = torch.nn.Parameter(untied)
    untied_error = send()
    after_untied = engine_embedding()
    hf.lm_head.weight = hf.model.embed_tokens.weight  # (4) tied again
    retied_error = send()
    retied_logprobs = engine_logprobs()
    print(
        json.dumps(
            {
                "random_error": random_error,
                "random_embedding_equal": torch.equal(after_random, sent_random),
                "random_moved": moved(random_logprobs, fresh),
                "random_worst_against_hf": random_worst,
                "again_error": again_error,
                "again_embedding_equal": torch.equal(after_again, after_random),
                "again_logprobs_equal": again_logprobs == random_logprobs,
                "untied_error": untied_error,
                "untied_embedding_sent": torch.equal(after_untied, hf.model.embed_tokens.weight.detach()),
                "retied_error": retied_error,
                "retied_embedding_equal": torch.equal(engine_embedding(), hf.model.embed_tokens.weight.detach()),
                "retied_worst_against_hf": worst_against_hf(retied_logprobs),
                "seconds": time.perf_counter() - started,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
