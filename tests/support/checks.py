"""The test job's checks beyond the demo's weight check: what a failed sync claims of the engine, the adapter syncs'
checks (colocated and server), and the count of FSDP's own unshards (an adapter sync unshards no base parameter).

Test-side only: the demo's check is `fsdp_sync._demo.weight_check`, which these extend.
"""

from __future__ import annotations

from typing import Any

from fsdp_sync.report import AdapterFigures
from fsdp_sync._demo.weight_check import EngineChecker, ServerChecker, engine_of, full_reference_model, wrapper_info


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


class EngineClaimChecker(EngineChecker):
    """The in-process check, plus what a failed sync claims (`SyncError.engine`), checked against the engine."""

    def snapshot(self) -> dict[str, Any]:
        from fsdp_sync._demo.engine import engine_state

        return engine_state(engine_of(self.trainer))

    def check_claim(self, before: dict[str, Any], state: Any) -> dict[str, Any]:
        """After a failed sync: does the engine hold what the error says? Every engine weight named as holding its
        previous value must equal the snapshot taken before the sync; every other one (except those loaded from
        tensors named undefined) must equal the trainer's new full weight, bit for bit."""
        from fsdp_sync.compat.engine_api import engine_handle, engine_name_mapper, packed_modules
        from fsdp_sync.compat.reload_api import load_dtypes
        from fsdp_sync._demo.engine import (
            as_loaded,
            by_engine_name,
            engine_state,
            expected_checkpoint_state,
            expected_engine_tensor,
        )

        llm = engine_of(self.trainer)
        after = engine_state(llm)
        handle = engine_handle(llm)
        packed = packed_modules(handle.model)
        to_engine = engine_name_mapper(handle.model)
        # NOTE: as the direct check after a good sync (`as_loaded`).
        loads = load_dtypes(handle.model)
        checkpoint = by_engine_name(expected_checkpoint_state(self._full_model()), to_engine)
        undefined = set(by_engine_name(dict.fromkeys(state.undefined), to_engine)) if state is not None else set()
        problems: list[str] = []
        counts = {"previous": 0, "new": 0, "undefined": 0, "unchecked": 0}
        for name, value in after.items():
            if value.is_floating_point() and not bool(value.isfinite().all()):
                problems.append(f"{name}: holds NaN or Inf")
            if state is not None and name in state.previous:
                counts["previous"] += 1
                if not torch_equal(value, before[name]):
                    problems.append(f"{name}: said to hold its previous value, but differs from it")
                continue
            module, _, leaf = name.rpartition(".")
            parent, _, last = module.rpartition(".")
            sources = {f"{parent}.{p}.{leaf}" for p in packed.get(last, [])} or {name}
            if sources & undefined:
                counts["undefined"] += 1
                continue
            expected = expected_engine_tensor(name, checkpoint, packed)
            if expected is None:
                counts["unchecked"] += 1
                continue
            if state is not None and state.status == "unchanged":
                counts["previous"] += 1
                if not torch_equal(value, before[name]):
                    problems.append(f"{name}: the engine was said to be unchanged, but this weight changed")
                continue
            if torch_equal(value, as_loaded(expected, loads.get(name, handle.dtype), value.dtype)):
                counts["new"] += 1
            elif state is None and torch_equal(value, before[name]):
                counts["previous"] += 1
            else:
                problems.append(f"{name}: said to hold the new value, but differs from the trainer's full weight")
        return {"problems": problems, "counts": counts}


class ServerClaimChecker(ServerChecker):
    """The server check, plus what a failed sync claims, checked on every worker of the server."""

    @staticmethod
    def _joined(workers: dict[str, dict[str, str]]) -> dict[str, str]:
        """`worker:engine name` -> sha256, for every worker of the server (each TP rank of each DP replica)."""
        return {f"{worker}:{name}": d for worker, digests in workers.items() for name, d in digests.items()}

    def snapshot(self) -> dict[str, str]:
        from fsdp_sync._demo.vllm_server import server_worker_digests

        return self._joined(server_worker_digests(self.client.base_url))

    def check_claim(self, before: dict[str, str], state: Any) -> dict[str, Any]:
        """After a failed sync: every server weight, on every worker, must hold its previous value (its digest before
        the sync) or its new one (the trainer's full weight cut as the worker's loader cuts it): never a third, and
        all previous when the error says unchanged."""
        from fsdp_sync.compat.tp_shards import expected_shard
        from fsdp_sync._demo.engine import digest_matches, expected_engine_parts
        from fsdp_sync._demo.vllm_server import server_shard_rules, server_worker_digests

        full, _ = full_reference_model(self.trainer, self.peft_config)
        checkpoint, packed = self._expected(full)
        workers = server_worker_digests(self.client.base_url)
        rules = server_shard_rules(self.client.base_url, workers)
        problems: list[str] = []
        counts = {"previous": 0, "new": 0, "undefined": 0, "unchecked": 0}
        for key, digest in self._joined(workers).items():
            worker, _, name = key.rpartition(":")
            parts = expected_engine_parts(name, checkpoint, packed)
            rule = rules.get(worker, {}).get(name)
            if parts is None or rule is None:
                counts["unchecked"] += 1
                continue
            if state is not None and state.status == "unchanged" and digest != before.get(key):
                problems.append(f"{key}: the server was said to be unchanged, but this weight changed")
            elif digest_matches(digest, expected_shard(parts, rule), self.info.dtype):
                counts["new"] += 1
            elif digest == before.get(key):
                counts["previous"] += 1
            else:
                counts["undefined"] += 1
                problems.append(f"{key}: holds neither its previous nor its new value")
        return {"problems": problems, "counts": counts}


class AdapterChecker:
    """The check after an adapter sync, on every rank (colocated): the engine's LoRA manager holds exactly the
    trainer's adapter (read back, bit for bit: `lora_A` as is, `lora_B` with the adapter's scaling folded in, as vLLM
    keeps it), only the current version is loaded, and the engine's logprobs, served on the adapter, equal those of
    the trainer's full model (PEFT's own merge of the same weights) within the tolerance of the merged checks."""

    def __init__(self, trainer: Any, peft_config: Any) -> None:
        self.trainer = trainer
        self.peft_config = peft_config
        self.records: list[dict[str, Any]] = []

    def __call__(self) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp_sync.backend import unwrap_outer
        from fsdp_sync.compat.engine_api import engine_handle, packed_modules
        from fsdp_sync.compat.lora_api import engine_adapter, loaded_adapters
        from fsdp_sync._demo.engine import LOGPROB_PROMPTS, logprobs_check

        llm = engine_of(self.trainer)
        handle = engine_handle(llm)
        request = self.trainer.adapter_request
        held = engine_adapter(handle.worker, request.lora_int_id)
        state = get_model_state_dict(
            unwrap_outer(self.trainer.model_wrapped), options=StateDictOptions(full_state_dict=True)
        )
        scaling = adapter_scaling(self.peft_config)
        packed = packed_modules(handle.model)
        problems: list[str] = []
        compared = 0
        for name, value, kind, engine_module, slot in _adapter_targets(state, packed):
            a_list, b_list = held.get(engine_module, ([], []))
            got = (a_list if kind == "lora_A" else b_list)[slot] if slot < len(a_list) else None
            compared += 1
            # NOTE: cast to the engine's LoRA dtype, then scaled, as vLLM folds the scaling (`optimize`, after its
            # load in the LoRA dtype): with a scaling that is not a power of two the other order rounds differently.
            expected = value.detach().cpu().to(got.dtype) if got is not None else None
            if expected is not None and kind == "lora_B":
                expected = expected * scaling
            if got is None or not torch_equal(got.cpu(), expected):
                problems.append(f"{name}: the engine's {engine_module}[{slot}] differs from the trainer's")
        full, lora_delta = full_reference_model(self.trainer, self.peft_config)
        logits_problems = logprobs_check(llm, full, self.trainer.processing_class, handle.dtype)
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        engine_logprobs = []
        for prompt in LOGPROB_PROMPTS:
            ids = self.trainer.processing_class(prompt)["input_ids"]
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
            engine_logprobs.append({int(t): lp.logprob for t, lp in out.items()})
        self.records.append(
            {
                "step": self.trainer.state.global_step,
                "wrapper": wrapper_info(self.trainer.model_wrapped),
                "adapter_id": request.lora_int_id,
                "loaded": loaded_adapters(handle.worker),
                "compared": compared,
                "adapter_problems": problems,
                "logits_problems": logits_problems,
                "engine_logprobs": engine_logprobs,
                "lora_delta": lora_delta,
            }
        )


class UnshardCounter:
    """Counts FSDP's own unshards (FSDP1 `FlatParamHandle.unshard`, FSDP2 `FSDPParamGroup.unshard`) and the
    all-gathers of any collective, by elements, for the proof that an adapter sync unshards no base parameter."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp._flat_param import FlatParamHandle
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.unshards = 0
        self.gathered = 0
        for owner, attribute in ((FlatParamHandle, "unshard"), (FSDPParamGroup, "unshard")):
            self._count(owner, attribute)
        original = dist.all_gather_into_tensor

        def all_gather_into_tensor(output: Any, *args: Any, **kwargs: Any) -> Any:
            self.gathered += output.numel()
            return original(output, *args, **kwargs)

        dist.all_gather_into_tensor = all_gather_into_tensor

    def _count(self, owner: type, attribute: str) -> None:
        original = getattr(owner, attribute)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.unshards += 1
            return original(*args, **kwargs)

        setattr(owner, attribute, counted)


def _adapter_targets(state: dict[str, Any], packed: dict[str, Any]) -> Any:
    """(trainer key, tensor, "lora_A" or "lora_B", engine module, slot in it) for every adapter tensor of `state`:
    a module fused in the engine (q/k/v into `qkv_proj`) holds each member's adapter at the member's slot."""
    for key, value in state.items():
        parts = key.split(".")
        kind = next((p for p in parts if p in ("lora_A", "lora_B")), None)
        if kind is None:
            continue
        module = ".".join(parts[: parts.index(kind)]).removeprefix("base_model.model.")
        parent, _, leaf = module.rpartition(".")
        engine_module, slot = module, 0
        for fused, members in packed.items():
            if leaf in members:
                engine_module, slot = f"{parent}.{fused}", list(members).index(leaf)
        yield key, value, kind, engine_module, slot


def adapter_scaling(peft_config: Any) -> float:
    """The scaling PEFT gives every adapted module of `peft_config` (`alpha / r`, rsLoRA `alpha / sqrt(r)`).

    Raises:
        ValueError: per-module ranks or alphas, where one scaling does not hold for every module.
    """
    import math

    if getattr(peft_config, "rank_pattern", None) or getattr(peft_config, "alpha_pattern", None):
        raise ValueError("the demo's adapter check takes one scaling; this config has per-module ranks or alphas")
    root = math.sqrt(peft_config.r) if getattr(peft_config, "use_rslora", False) else peft_config.r
    return peft_config.lora_alpha / root


class AdapterServerChecker(ServerClaimChecker):
    """The adapter check against a server (every rank): every worker's LoRA manager holds exactly the trainer's
    adapter under its name (sha256 of each `lora_a`/`lora_b` as vLLM keeps it, read from each of the server's
    workers), the versions each worker serves and holds are recorded, and the server's logprobs for the adapter's name
    equal those of the trainer's full model (PEFT's merge)."""

    def __call__(self) -> None:
        import dataclasses

        import requests
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp_sync.backend import unwrap_outer
        from fsdp_sync.compat.engine_api import packed_modules_for_architectures
        from fsdp_sync.digest import tensor_digest
        from fsdp_sync._demo.engine import LOGPROB_PROMPTS
        from fsdp_sync._demo.vllm_server import server_adapter_digests

        adapter_id = self.trainer.sync_reports[-1].figure(AdapterFigures).adapter_id
        name = f"fsdp-vllm-sync-v{adapter_id}"
        info = self.info
        self.info = dataclasses.replace(info, served_name=name)
        try:
            full, lora_delta = full_reference_model(self.trainer, self.peft_config)
            logits_problems = self._logprobs_problems(full)  # the first request naming the adapter loads it
            engine_logprobs = []
            for prompt in LOGPROB_PROMPTS:
                ids = self.trainer.processing_class(prompt)["input_ids"]
                body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 5,
                        "return_tokens_as_token_ids": True}  # fmt: skip
                answer = requests.post(f"{self.client.base_url}/v1/completions", json=body, timeout=120).json()
                top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
                engine_logprobs.append({int(t.split(":", 1)[1]): lp for t, lp in top.items()})
        finally:
            self.info = info
        workers = server_adapter_digests(self.client.base_url)
        state = get_model_state_dict(
            unwrap_outer(self.trainer.model_wrapped), options=StateDictOptions(full_state_dict=True)
        )
        scaling = adapter_scaling(self.peft_config)
        base_config = unwrap_outer(self.trainer.model_wrapped).get_base_model().config
        packed = packed_modules_for_architectures(list(base_config.architectures or []))
        problems: list[str] = []
        compared = 0
        # NOTE: every worker (each tensor-parallel rank, each data-parallel replica) builds the whole adapter from
        # what it received; vLLM slices it into the layers' shards when it activates it.
        for key, value, kind, engine_module, slot in _adapter_targets(state, packed):
            expected = value.detach().cpu().to(info.dtype)
            digest = tensor_digest(expected if kind == "lora_A" else expected * scaling)
            for worker in workers:
                modules = worker["adapters"].get(name, {})
                held = modules.get(engine_module, {}).get("a" if kind == "lora_A" else "b", [])
                compared += 1
                if slot >= len(held) or held[slot] != digest:
                    problems.append(
                        f"{key}: worker {worker['worker']}'s {engine_module}[{slot}] of {name} differs from the trainer's"
                    )
        self.records.append(
            {
                "step": self.trainer.state.global_step,
                "wrapper": wrapper_info(self.trainer.model_wrapped),
                "adapter_id": adapter_id,
                "workers": len(workers),
                "worker_tags": [w["worker"] for w in workers],
                "loaded": [w["ids"] for w in workers],
                "served": [w["served"] for w in workers],
                "compared": compared,
                "adapter_problems": problems,
                "logits_problems": logits_problems,
                "engine_logprobs": engine_logprobs,
                "lora_delta": lora_delta,
            }
        )
