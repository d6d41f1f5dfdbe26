"""`compat.rpc_responses`: after a call that failed on its workers, vLLM's multiprocess executor reads every worker's
answer, so the next call gets its own answers (unpatched, worker 1's answer to the failed call answered the next one:
every sync after an aborted round on a tensor-parallel server failed). The executor's own `collective_rpc` runs on a
stand-in holding the queues it reads (two workers' answer queues)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

from fsdp_sync.compat.rpc_responses import read_every_worker_answer

pytestmark = pytest.mark.unit

OK, FAILED = WorkerProc.ResponseStatus.SUCCESS, WorkerProc.ResponseStatus.FAILURE


class _Answers:
    """One worker's answer queue: what it answered, in order."""

    def __init__(self) -> None:
        self.queue: deque = deque()

    def dequeue(self, timeout: float | None = None):
        if not self.queue:
            raise TimeoutError
        return self.queue.popleft()


def _executor() -> SimpleNamespace:
    return SimpleNamespace(
        rpc_broadcast_mq=SimpleNamespace(enqueue=lambda message: None),
        response_mqs=[_Answers(), _Answers()],
        futures_queue=deque(),
        is_failed=False,
    )


def _two_calls(call) -> object:
    """A call that fails on both workers, then one that succeeds on both: what the second returns."""
    executor = _executor()
    first, second = executor.response_mqs
    first.queue += [(FAILED, "aborted"), (OK, "w0")]
    second.queue += [(FAILED, "aborted"), (OK, "w1")]
    with pytest.raises(RuntimeError, match="aborted"):
        call(executor, "update_weights", timeout=5)
    try:
        return call(executor, "shard_rules", timeout=5)
    except RuntimeError as e:
        return e


def test_unpatched_the_failed_calls_later_answers_answer_the_next_call() -> None:
    """What the patch is for: vLLM's own reader stops at worker 0's failure."""
    original = getattr(MultiprocExecutor.collective_rpc, "__wrapped__", MultiprocExecutor.collective_rpc)
    after = _two_calls(original)
    assert isinstance(after, RuntimeError) and "aborted" in str(after)  # worker 1's answer to the failed call


def test_patched_every_answer_is_read_and_the_next_call_gets_its_own() -> None:
    assert read_every_worker_answer() and read_every_worker_answer()  # idempotent
    assert _two_calls(MultiprocExecutor.collective_rpc) == ["w0", "w1"]


def test_patched_a_single_reply_rank_and_a_timeout_read_as_before() -> None:
    read_every_worker_answer()
    executor = _executor()
    executor.response_mqs[1].queue.append((OK, "w1"))
    assert MultiprocExecutor.collective_rpc(executor, "m", timeout=5, unique_reply_rank=1) == "w1"
    with pytest.raises(TimeoutError, match="RPC call to m timed out"):
        MultiprocExecutor.collective_rpc(executor, "m", timeout=5)
