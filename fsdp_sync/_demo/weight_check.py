"""The demo's weight check after a sync: every engine weight equals the trainer's full weight, bit for bit.

On every rank, after each sync of the job (`fsdp_sync._demo.grpo_job`):
1. the engine's weights are read back (engine names, fused; a server's through its workers' own sha256 digests,
   every tensor-parallel worker by the cut its loader takes);
2. the trainer's full weights are taken independently of the sync (torch's
   `get_model_state_dict(full_state_dict=True)`), loaded into an unsharded copy (PEFT adapters merged by PEFT itself);
3. every engine weight is compared bit for bit with that copy, directly (q/k/v and gate/up re-concatenated) and, in
   process, through the engine's own loader (the copy is loaded into a reference engine state and read back).
The engine's first-token logprobs are compared with the trainer's model's and its greedy completions recorded.
"""

from __future__ import annotations

from typing import Any

# The prompts the job trains on; the check generates from the first four.
PROMPTS = [
    "the a of",
    "in is it",
    "you that he",
    "was for on",
    "are with as",
    "his they be",
    "at one have",
    "this from or",
]


def engine_of(trainer: Any) -> Any:
    """The trainer's in-process vLLM engine (TRL >= 0.28 trainers keep it on `vllm_generation`, OnlineDPO on itself)."""
    generation = getattr(trainer, "vllm_generation", None)
    return generation.llm if generation is not None else trainer.llm


def wrapper_info(model: Any) -> dict[str, Any]:
    """Which wrapper holds the model: accelerate on CPU falls back to DDP silently, so every check records it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    return {
        "type": type(model).__name__,
        "is_fsdp1": isinstance(model, FSDP),
        "is_fsdp2": isinstance(model, FSDPModule),
        "is_ddp": isinstance(model, DDP),
    }


def full_reference_model(trainer: Any, peft_config: Any) -> tuple[Any, float | None]:
    """The trainer's full weights in an unsharded model (PEFT adapters merged by PEFT itself), taken independently
    of the sync (torch's `get_model_state_dict(full_state_dict=True)`, a collective: every rank calls it).

    Returns:
        (model, lora_delta): how far the adapters move the pushed weights (None without PEFT); a check with a zero
        delta would prove nothing.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from fsdp_sync.backend import unwrap_outer
    from fsdp_sync._demo.models import auto_model_class

    wrapped = trainer.model_wrapped
    state = get_model_state_dict(unwrap_outer(wrapped), options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().to("cpu") for k, v in state.items()}
    config = unwrap_outer(wrapped).config
    if peft_config is not None:
        config = unwrap_outer(wrapped).get_base_model().config
    ref = auto_model_class(config).from_config(config, dtype=torch.float32)
    if peft_config is not None:
        from peft import get_peft_model

        ref = get_peft_model(ref, peft_config)
        ref.load_state_dict(state, strict=True)
        bases = {k.replace(".base_layer", ""): v for k, v in state.items() if ".base_layer." in k}
        merged = ref.merge_and_unload()
        delta = max(
            (merged.get_parameter(k.removeprefix("base_model.model.")) - v).abs().max().item() for k, v in bases.items()
        )
        return merged, delta
    missing, unexpected = ref.load_state_dict(state, strict=False)
    real_missing = [m for m in missing if m not in ("lm_head.weight",)]
    if real_missing or unexpected:
        raise RuntimeError(f"reference load: missing {real_missing}, unexpected {unexpected}")
    return ref, None

class EngineChecker:
    """The bit-exact check after each sync on the rank's in-process engine (see the module docstring)."""

    def __init__(self, trainer: Any, peft_config: Any) -> None:
        self.trainer = trainer
        self.peft_config = peft_config
        self.records: list[dict[str, Any]] = []
        self.lora_delta: float | None = None

    def _full_model(self) -> Any:
        model, self.lora_delta = full_reference_model(self.trainer, self.peft_config)
        self._last_full = model
        return model

    def __call__(self) -> None:
        from vllm import SamplingParams

        from fsdp_sync.compat.engine_api import engine_handle, engine_name_mapper, packed_modules
        from fsdp_sync.compat.reload_api import load_dtypes
        from fsdp_sync._demo.engine import (
            by_engine_name,
            compare_states,
            engine_state,
            expected_checkpoint_state,
            fused_direct_check,
            logprobs_check,
            reference_engine_state,
        )

        llm = engine_of(self.trainer)
        after_sync = engine_state(llm)
        checkpoint = expected_checkpoint_state(self._full_model())
        handle = engine_handle(llm)
        packed = packed_modules(handle.model)
        direct_checked, direct_problems = fused_direct_check(
            after_sync,
            by_engine_name(checkpoint, engine_name_mapper(handle.model)),
            packed,
            handle.dtype,
            load_dtypes=load_dtypes(handle.model),
        )
        full = self._last_full
        logits_problems = logprobs_check(llm, full, self.trainer.processing_class, handle.dtype)
        reference = reference_engine_state(llm, checkpoint)
        problems = compare_states(after_sync, reference)
        prompts = [{"prompt_token_ids": self.trainer.processing_class(p)["input_ids"]} for p in PROMPTS[:4]]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        self.records.append(
            {
                "step": self.trainer.state.global_step,
                "wrapper": wrapper_info(self.trainer.model_wrapped),
                "engine_weights": len(after_sync),
                "direct_checked": direct_checked,
                "direct_problems": direct_problems,
                "reference_problems": problems,
                "logits_problems": logits_problems,
                "greedy": [list(o.outputs[0].token_ids) for o in outputs],
                "lora_delta": self.lora_delta,
            }
        )


class ServerChecker:
    """After each sync, every server weight is compared with the trainer's full weight, bit for bit, through the
    server's own per-parameter sha256 digests (`/weight_checker`, read back from the server process), and the
    server's greedy completions are recorded."""

    def __init__(self, trainer: Any, peft_config: Any, base_url: str) -> None:
        from fsdp_sync.server_client import ServerClient

        self.trainer = trainer
        self.peft_config = peft_config
        self.client = ServerClient(base_url, timeout=120)
        self.info = self.client.server_info()
        self.records: list[dict[str, Any]] = []

    def _greedy(self) -> list[list[int]]:
        import requests

        outputs = []
        for prompt in PROMPTS[:4]:
            ids = self.trainer.processing_class(prompt)["input_ids"]
            body = {"model": self.info.served_name, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "seed": 0,
                    "return_token_ids": True}  # fmt: skip
            answer = requests.post(f"{self.client.base_url}/v1/completions", json=body, timeout=120).json()
            choice = answer["choices"][0]
            outputs.append(list(choice.get("token_ids") or []) or [choice["text"]])
        return outputs

    def _logprobs_problems(self, full: Any) -> list[str]:
        """The server's first-token logprobs against the trainer's model (as `logprobs_check` does in-process)."""
        import requests
        import torch

        from fsdp_sync._demo.engine import LOGPROB_PROMPTS, reference_at

        from fsdp_sync._demo.vllm_server import server_replicas

        reference = reference_at(full, self.info.dtype)
        problems: list[str] = []
        # NOTE: every data-parallel replica answers each prompt (vLLM routes a request to the replica its
        # `X-data-parallel-rank` header names): each replica's weights, or adapter, serve.
        replicas = server_replicas(self.client.base_url)
        for prompt in LOGPROB_PROMPTS:
            ids = self.trainer.processing_class(prompt)["input_ids"]
            with torch.no_grad():
                expected = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            body = {"model": self.info.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 20,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            for replica in range(replicas):
                headers = {"X-data-parallel-rank": str(replica)} if replicas > 1 else {}
                url = f"{self.client.base_url}/v1/completions"
                answer = requests.post(url, json=body, headers=headers, timeout=120).json()
                top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
                engine = {int(token.split(":", 1)[1]): lp for token, lp in top.items()}
                on = f"replica {replica} of the server" if replicas > 1 else "the server"
                for token in torch.topk(expected, 3).indices.tolist():
                    got = engine.get(token)
                    if got is None or abs(got - expected[token].item()) > 0.15:
                        problems.append(f"{prompt!r}: token {token} logprob {got} on {on}, {expected[token].item():.3f}")
        full.float()
        return problems

    def _expected(self, full: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
        from fsdp_sync.compat.engine_api import engine_model_class, engine_name_mapper, packed_modules_for_architectures
        from fsdp_sync._demo.engine import by_engine_name, expected_checkpoint_state

        architectures = list(full.config.architectures)
        checkpoint = by_engine_name(
            expected_checkpoint_state(full), engine_name_mapper(engine_model_class(architectures))
        )
        return checkpoint, packed_modules_for_architectures(architectures)

    def __call__(self) -> None:
        from fsdp_sync._demo.engine import worker_digest_check
        from fsdp_sync._demo.vllm_server import server_shard_rules, server_worker_digests

        full, lora_delta = full_reference_model(self.trainer, self.peft_config)
        workers = server_worker_digests(self.client.base_url)
        rules = server_shard_rules(self.client.base_url, workers)
        checkpoint, packed = self._expected(full)
        checked, problems = worker_digest_check(workers, rules, checkpoint, packed, self.info.dtype)
        logits_problems = self._logprobs_problems(full)
        self.records.append(
            {
                "step": self.trainer.state.global_step,
                "wrapper": wrapper_info(self.trainer.model_wrapped),
                "workers": sorted(workers),
                "engine_weights": sum(len(d) for d in workers.values()),
                "direct_checked": checked,
                "direct_problems": problems,
                "reference_problems": [],
                "logits_problems": logits_problems,
                "greedy": self._greedy(),
                "lora_delta": lora_delta,
            }
        )
