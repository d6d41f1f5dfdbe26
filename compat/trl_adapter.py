"""TRL's colocated generation, arranged for adapter syncs: the engine TRL builds started with LoRA enabled, and its
generate calls asking for the adapter the last sync loaded (TRL 1.16's `trl/generation/vllm_generation.py`).

Why: TRL builds its colocated `vllm.LLM` itself (`VLLMGeneration.__init__`, with no LoRA options) and calls
`llm.generate(prompts, sampling_params=..., use_tqdm=False)` with no `lora_request` (GRPOTrainer and RLOOTrainer
both generate through `VLLMGeneration.generate`). An adapter pushed into the engine serves only requests that name
it, so the mixin starts the engine with LoRA (`engine_with_lora`) and wraps the engine's `generate` and `chat` so
that a call without a `lora_request` asks for the current adapter (`ask_for_adapter`). In server mode TRL's
`VLLMClient.generate` names the model it asks for (`client.model`, the server's first model at start): it asks for
the current adapter's name instead (`ask_server_for_adapter`). TRL's `AsyncGRPOTrainer` generates in a rollout
process of its own, which names each request `<lora_name>-v<model_version>` once its `lora_name` is set
(`name_rollout_requests`).
"""

from __future__ import annotations

import contextlib
import functools
import typing
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "ask_for_adapter",
    "ask_server_for_adapter",
    "engine_with_lora",
    "lora_rank_for_engine",
    "name_rollout_requests",
    "peft_rank",
]

_ASKING = "_fvs_asks_for_adapter"


def peft_rank(peft_config: Any) -> int | None:
    """The largest rank of a PEFT LoRA config (its `r` and `rank_pattern`), or None for anything else."""
    r = getattr(peft_config, "r", None)
    if not isinstance(r, int):
        return None
    return max([r, *(getattr(peft_config, "rank_pattern", None) or {}).values()])


def lora_rank_for_engine(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves `rank` (vLLM takes only some values)."""
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above every max_lora_rank vLLM accepts ({allowed})")
    return fits[0]


@contextlib.contextmanager
def engine_with_lora(rank: int) -> Iterator[None]:
    """While open, the `vllm.LLM` that TRL's `VLLMGeneration` builds starts with LoRA enabled (one adapter slot in a
    batch, two kept loaded: the version requests name and the next one, staged beside it until its sync is verified
    and published; `max_lora_rank` the smallest vLLM value that serves `rank`)."""
    import trl.generation.vllm_generation as generation

    original = generation.LLM

    @functools.wraps(original)
    def with_lora(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_lora", True)
        kwargs.setdefault("max_lora_rank", lora_rank_for_engine(rank))
        kwargs.setdefault("max_loras", 1)
        kwargs.setdefault("max_cpu_loras", 2)
        return original(*args, **kwargs)

    generation.LLM = with_lora
    try:
        yield
    finally:
        generation.LLM = original


def ask_for_adapter(llm: Any, request: Callable[[], Any | None]) -> None:
    """Make `llm.generate` and `llm.chat` (on this engine object only) pass `lora_request=request()` where the caller
    passed none; once per engine."""
    if getattr(llm, _ASKING, False):
        return
    for method in ("generate", "chat"):
        original = getattr(llm, method, None)
        if original is None:
            continue

        def asking(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if kwargs.get("lora_request") is None:
                kwargs["lora_request"] = request()
            return _original(*args, **kwargs)

        setattr(llm, method, asking)
    setattr(llm, _ASKING, True)


def ask_server_for_adapter(client: Any, name: Callable[[], Any | None]) -> None:
    """Make TRL's `VLLMClient.generate` (this client only) ask the server for the adapter `name()` (the model it
    names in each request); the base model's name while there is none yet; once per client."""
    if getattr(client, _ASKING, False):
        return
    base = client.model
    original = client.generate

    def asking(*args: Any, **kwargs: Any) -> Any:
        client.model = name() or base
        return original(*args, **kwargs)

    client.generate = asking
    setattr(client, _ASKING, True)


def name_rollout_requests(worker: Any, prefix: str) -> None:
    """Make TRL's async rollout worker ask for `<prefix>-v<model_version>` in every request (before it starts).

    TRL 1.16's `AsyncRolloutWorker` forwards its constructor's keyword arguments to the rollout process it spawns at
    `start()` (`_loop_kwargs`), and that process names each request `f"{lora_name}-v{model_version}"` once
    `lora_name` is set (`_AsyncRolloutLoop._request_model`); `AsyncGRPOTrainer.__init__` sets it only for its own
    adapter-files sync, never with a `weight_transfer` (the mixin's). Public API for it: none in TRL 1.16.

    Raises:
        RuntimeError: the worker has started already, or keeps no `lora_name` to set (another TRL version).
    """
    loop_kwargs = getattr(worker, "_loop_kwargs", None)
    if not isinstance(loop_kwargs, dict) or "lora_name" not in loop_kwargs:
        raise RuntimeError(
            f"{type(worker).__name__} keeps no `lora_name` for its rollout process (TRL 1.16's AsyncRolloutWorker "
            "does): this TRL version's rollout worker cannot be made to ask for each adapter version. Use "
            "SyncConfig(adapter=False) (merged syncs)."
        )
    if getattr(worker, "_process", None) is not None:
        raise RuntimeError("the rollout worker has started already: its requests can no longer be named")
    loop_kwargs["lora_name"] = prefix
