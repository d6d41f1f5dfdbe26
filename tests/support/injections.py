"""The test job's faults and probes: `--inject`/`--soak`/`--tamper-engine`/kills through the library's declared
fault points (`fsdp_sync.faults`), and the probe of what generation serves right after a failed adapter sync.

Test-side only.
"""

from __future__ import annotations

from typing import Any

from fsdp_sync._demo.weight_check import engine_of

# The points a soak draws from: reached by every sync of a full fine-tuning run (build and plan only by the first,
# merge only with PEFT, verify only with --verify).
SOAK_POINTS = ("check", "gather.prepare", "gather.launch", "gather.unflatten", "stream.map", "stream.cast", "write",
               "write.finish")  # fmt: skip


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
                engine_model(self.trainer).get_parameter(self.tamper[0]).add_(1)
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

        llm = engine_of(trainer)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        for prompt in LOGPROB_PROMPTS:  # the engine's generate, as TRL calls it (the mixin names the request)
            ids = trainer.processing_class(prompt)["input_ids"]
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
            logprobs.append({int(t): lp.logprob for t, lp in out.items()})
        # NOTE: asked of vLLM (the adapter ids its worker holds), not generated with: a request naming an id the
        # engine does not hold would make vLLM load it from its path, which names no file.
        probe["held_ids"] = sorted(int(i) for i in llm.llm_engine.list_loras())
        probe["kept_adapters"] = llm.llm_engine.vllm_config.lora_config.max_cpu_loras
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


def engine_model(trainer: Any) -> Any:
    from fsdp_sync.compat.engine_api import engine_handle

    return engine_handle(engine_of(trainer)).model
