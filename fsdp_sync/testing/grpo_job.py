"""A short real GRPO/RLOO run with an in-process vLLM engine, checking the engine after every weight sync.

Launched once per rank (`accelerate launch ... -m fsdp_sync.testing.grpo_job`); each rank writes
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
    p.add_argument("--peft", action="store_true", help="train a LoRA adapter (r=4 on q_proj, v_proj)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--torch-compile", default=None, help="compile the model with this torch.compile backend")
    p.add_argument("--check", action="store_true", help="bit-exact engine check after every sync")
    p.add_argument("--stock", action="store_true", help="TRL's own sync (no mixin), recorded as it behaves")
    p.add_argument(
        "--stock-reload",
        action="store_true",
        help="TRL's own sync with its per-tensor engine call routed through the in-place reload (one per tensor)",
    )
    p.add_argument("--perturb", type=float, default=0.02, help="std of the noise added before training")
    return p.parse_args(argv)


def _setup_env() -> None:
    # In-process engine (its model is reachable) with a small explicit KV cache (CPU: GiB).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


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
    """The trainer's in-process vLLM engine (TRL 1.x trainers keep it on `vllm_generation`, OnlineDPO on itself)."""
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


class EngineChecker:
    """Runs the bit-exact check after each sync (see module docstring)."""

    def __init__(self, trainer: Any, peft_config: Any) -> None:
        self.trainer = trainer
        self.peft_config = peft_config
        self.records: list[dict[str, Any]] = []
        self.lora_delta: float | None = None

    def _full_model(self) -> Any:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForCausalLM

        from fsdp_sync.backend import unwrap_outer

        wrapped = self.trainer.model_wrapped
        state = get_model_state_dict(unwrap_outer(wrapped), options=StateDictOptions(full_state_dict=True))
        state = {k: v.detach().to("cpu") for k, v in state.items()}
        config = unwrap_outer(wrapped).config
        if self.peft_config is not None:
            config = unwrap_outer(wrapped).get_base_model().config
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if self.peft_config is not None:
            from peft import get_peft_model

            ref = get_peft_model(ref, self.peft_config)
            ref.load_state_dict(state, strict=True)
            bases = {k.replace(".base_layer", ""): v for k, v in state.items() if ".base_layer." in k}
            merged = ref.merge_and_unload()
            # How far the adapters move the pushed weights: a check with a zero delta would prove nothing.
            self.lora_delta = max(
                (merged.get_parameter(k.removeprefix("base_model.model.")) - v).abs().max().item()
                for k, v in bases.items()
            )
            return merged
        missing, unexpected = ref.load_state_dict(state, strict=False)
        real_missing = [m for m in missing if m not in ("lm_head.weight",)]
        if real_missing or unexpected:
            raise RuntimeError(f"reference load: missing {real_missing}, unexpected {unexpected}")
        return ref

    def __call__(self) -> None:
        from vllm import SamplingParams

        from fsdp_sync.compat.engine_api import engine_handle
        from fsdp_sync.testing.engine import (
            compare_states,
            engine_state,
            expected_checkpoint_state,
            fused_direct_check,
            reference_engine_state,
        )

        llm = _engine(self.trainer)
        after_sync = engine_state(llm)
        checkpoint = expected_checkpoint_state(self._full_model())
        handle = engine_handle(llm)
        packed = dict(getattr(type(handle.model), "packed_modules_mapping", {}) or {})
        direct_checked, direct_problems = fused_direct_check(after_sync, checkpoint, packed, handle.dtype)
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
                "greedy": [list(o.outputs[0].token_ids) for o in outputs],
                "lora_delta": self.lora_delta,
            }
        )


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
    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from fsdp_sync.testing.cpu_fsdp import enable_real_fsdp_on_cpu

        enable_real_fsdp_on_cpu()
    if args.check:
        from fsdp_sync.testing.engine import keep_engine_weights_readable

        keep_engine_weights_readable()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_sync import FSDPVLLMSyncMixin, SyncConfig
    from fsdp_sync.testing.cpu_fsdp import restore_fsdp_distributed_type

    trainer_cls, config_cls, trainer_fields = _trainer_classes(args.trainer)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)  # same noise on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * args.perturb)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    common = dict(
        output_dir=str(Path(args.out_dir) / "trainer"),
        per_device_train_batch_size=2,
        max_steps=args.steps,
        learning_rate=args.lr,
        use_vllm=True,
        vllm_mode="colocate",
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
    if stock:
        trainer = trainer_cls(**kwargs)
    else:
        synced = type(f"Synced{trainer_cls.__name__}", (FSDPVLLMSyncMixin, trainer_cls), {})
        sync_config = SyncConfig(fsdp1_strategy=args.fsdp1_strategy, fsdp2_strategy=args.fsdp2_strategy)
        trainer = synced(sync_config=sync_config, **kwargs)
    restore_fsdp_distributed_type(trainer)

    result: dict[str, Any] = {"rank": trainer.accelerator.process_index, "args": vars(args), "pushed": []}
    if args.stock_reload:
        _route_load_weights_to_reload(trainer, result["pushed"])
    checker = EngineChecker(trainer, peft_config) if args.check else None
    # The sync entry point: TRL 1.x's `vllm_generation.sync_weights`, or OnlineDPO's `_move_model_to_vllm`.
    if hasattr(trainer, "vllm_generation"):
        owner, attribute = trainer.vllm_generation, "sync_weights"
    else:
        owner, attribute = trainer, "_move_model_to_vllm"
    inner_sync = getattr(owner, attribute)
    sync_seconds: list[float] = []

    def checked_sync() -> None:
        start = time.perf_counter()
        inner_sync()
        sync_seconds.append(time.perf_counter() - start)
        if checker is not None:
            checker()

    setattr(owner, attribute, checked_sync)
    start = time.perf_counter()
    try:
        trainer.train()
        result["error"] = None
    except Exception as e:  # recorded for the stock run; re-raised below
        result["error"] = {"type": type(e).__name__, "message": str(e)[:2000], "traceback": traceback.format_exc()}
    result["train_seconds"] = time.perf_counter() - start
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
    result["checks"] = checker.records if checker is not None else []
    result["logged"] = [h for h in trainer.state.log_history if any(k.startswith("weight_sync/") for k in h)]
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    rank = result["rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if result["error"] is not None:
        print(result["error"]["traceback"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
