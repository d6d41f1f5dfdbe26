"""A patch of vLLM's multiprocess executor: a failed worker call reads every worker's answer before raising.

Why: `MultiprocExecutor.collective_rpc` (vLLM 0.32's `vllm/v1/executor/multiproc_executor.py`, `get_response`) reads
the workers' answers in rank order and raises at the first failed one. The later workers' answers to that call stay
in their queues, and answer the next call in its place: on a tensor-parallel server, after one weight update that
failed on every worker (a round the trainer aborted), every later call got worker 1's answer to the call before it
(measured: the next `/collective_rpc` returned the aborted update's error as worker 1's answer, and every sync after
it failed). Single-worker engines (every data-parallel replica of one worker) have one queue and are not affected.

The patch keeps vLLM's own call and only replaces how its answers are read, for calls without output aggregators
other than the generation steps (every call this package makes): all answers are read (within the call's timeout),
then the first failure is raised.
Feature-detected: applied where the executor's call returns a future whose reader can be replaced
(`FutureWrapper.get_response`); elsewhere logged and left as is. Installed in every vLLM process by the package's
plugin (`fsdp_sync.transfer.plugin.register`); the engine core's executor is the one that reads the answers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Any

__all__ = ["read_every_worker_answer"]

logger = logging.getLogger(__name__)

_PATCHED = "_fsdp_vllm_sync_reads_every_answer"
# The engine's own generation steps keep vLLM's reader as it is: a failure there ends the engine anyway, and their
# futures are the ones vLLM pipelines (non-blocking); only the other calls (weight updates, questions) are read whole.
_GENERATION_CALLS = frozenset({"execute_model", "sample_tokens"})


def read_every_worker_answer() -> bool:
    """Install the patch (idempotent). Returns whether it is installed."""
    try:
        from vllm.v1.executor.multiproc_executor import FutureWrapper, MultiprocExecutor, WorkerProc
    except ImportError:
        return False
    original = MultiprocExecutor.collective_rpc
    if getattr(original, _PATCHED, False):
        return True
    parameters = inspect.signature(original).parameters
    if not {"non_block", "unique_reply_rank", "timeout"} <= set(parameters) or "get_response" not in inspect.signature(
        FutureWrapper.__init__
    ).parameters:
        logger.info("fsdp-vllm-sync: this vLLM's executor reads worker answers otherwise; not patched")
        return False
    success = WorkerProc.ResponseStatus.SUCCESS

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False, unique_reply_rank: int | None = None, **aggregators: Any) -> Any:  # fmt: skip
        if any(a is not None for a in aggregators.values()) or method in _GENERATION_CALLS:
            return original(self, method, timeout, args, kwargs, non_block, unique_reply_rank, **aggregators)
        deadline = None if timeout is None else time.monotonic() + timeout
        future = original(self, method, timeout, args, kwargs, True, unique_reply_rank)
        queues = self.response_mqs if unique_reply_rank is None else (self.response_mqs[unique_reply_rank],)

        def every_answer() -> Any:
            answers, failed = [], None
            for queue in queues:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    status, result = queue.dequeue(timeout=wait)
                except TimeoutError as e:
                    raise TimeoutError(f"RPC call to {method} timed out.") from e
                if status != success and failed is None:
                    failed = result
                answers.append(result)
            if failed is not None:
                raise RuntimeError(f"Worker failed with error '{failed}', please check the stack trace above for the root cause")
            return answers[0] if unique_reply_rank is not None else answers

        # NOTE: replaced before anything reads the future (this thread made it and has not waited on it yet).
        future.get_response = every_answer
        return future if non_block else future.result()

    setattr(collective_rpc, _PATCHED, True)
    MultiprocExecutor.collective_rpc = collective_rpc  # type: ignore[method-assign]
    return True
