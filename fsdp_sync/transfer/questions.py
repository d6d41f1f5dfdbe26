"""Every question the trainer asks a vLLM server's workers: declared in one table (`QUESTIONS`), answered on the
workers through one method (`ASK_METHOD`, installed by `install`), asked through one function (`ask`).

Why one module: a question has two ends (a function inside each worker, a reader in the trainer) and a route between
them. Spread over string-named worker methods installed in three places, each end could change alone, and which
workers answered (the first data-parallel replica's, or every one) was decided by whichever route a caller used.

The route is declared per question (`Route`), because vLLM offers no single route that works for all of them:
- `/collective_rpc` (a development route) runs the method on every worker of every data-parallel replica, but answers
  with the first replica's workers only (vLLM 0.32's `DPLBAsyncMPClient.call_utility_async`). It needs nothing but
  the server, so it works for any weight-transfer backend and before the first sync (`Route.FIRST_REPLICA`).
- this package's gloo transfer group reaches every worker of every replica: each worker sends its answer to the
  trainer's sender over the group (`gloo_wire.gather_to_sender`), the request through `/collective_rpc` only
  triggers it (`Route.EVERY_REPLICA`). It exists only on a server whose backend is `gloo`, once a sync set it up.
A question is asked over the group where its answer differs between replicas; the table says, per question, why the
first replica's answer is the server's where it is not.

Where this runs: the worker side (`answer` and the answering functions) inside every vLLM worker process, installed
by the package's plugin (`fsdp_sync.transfer.plugin.register`, whatever the server's backend); `ask` in the trainer.
Like the rest of `fsdp_sync.transfer`, it imports no gatherer, no mixin and no TRL.
"""

from __future__ import annotations

import enum
import json
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypedDict

from .gloo_wire import gather_to_sender

__all__ = [
    "ASK_METHOD",
    "QUESTIONS",
    "AnswerGroup",
    "AsksServer",
    "Question",
    "Route",
    "WorkerAnswer",
    "answer",
    "ask",
    "install",
]

# The one method this package adds to vLLM's workers (`install`); `/collective_rpc` calls it by this name.
ASK_METHOD = "fsdp_vllm_sync_ask"


class Route(enum.Enum):
    """How the workers' answers to a question reach the trainer."""

    # `/collective_rpc`'s own answer: every worker of the first data-parallel replica. Any backend, any time.
    FIRST_REPLICA = "first_replica"
    # Over the gloo transfer group: every worker of every replica. Needs the trainer's gloo transfer engine.
    EVERY_REPLICA = "every_replica"


@dataclass(frozen=True)
class Question:
    """One question, as both ends know it.

    Attributes:
        name: what the trainer asks by.
        args: the type of each argument (JSON types: they travel in the request's body).
        answer: the type of each worker's answer (a JSON type, or a generic of one: `list[str]`), checked on
            arrival.
        answers: the worker-side function: `(vLLM worker, *args) -> answer`.
        route: how the answers come back (`Route`).
    """

    name: str
    args: tuple[type, ...]
    answer: Any
    answers: Callable[..., Any]
    route: Route


class WorkerAnswer(TypedDict):
    """One worker's answer: `worker` is its tag as its `/weight_checker` digests name it (`dp1:pp0:pcp0:tp0`; `""`
    on a vLLM without them)."""

    worker: str
    answer: Any


# --- the worker side: one function per question (`vLLM worker, *args -> answer`) ----------------------------------


def _engine_fixes(worker: Any) -> list[str]:
    """The reload fixes every weight-transfer engine of this worker applies (`compat.vllm_patches`)."""
    from fsdp_sync.compat.vllm_patches import applied_engine_fixes

    return list(applied_engine_fixes())


def _shard_rules(worker: Any) -> dict[str, Any]:
    """This worker's cut of every weight (`compat.tp_shards.shard_rules`): engine name -> `ShardRule` or None."""
    from fsdp_sync.compat.tp_shards import shard_rules

    return shard_rules(worker.model_runner.get_model())


def _kept_versions(worker: Any) -> int:
    """How many adapter versions this worker keeps servable (`compat.lora_patches.kept_versions`)."""
    from fsdp_sync.compat.lora_patches import kept_versions

    return kept_versions()


def _adapter_digests(worker: Any, name: str) -> dict[str, Any]:
    """sha256 of each tensor of the adapter version `name` as this worker keeps it to serve
    (`compat.lora_api.served_lora_tensors`), and the dtypes it holds them in; `held` False where it keeps no such
    version (with the versions it keeps)."""
    from fsdp_sync.compat.lora_api import served_lora_tensors
    from fsdp_sync.compat.lora_patches import kept_adapter, served_adapters
    from fsdp_sync.digest import tensor_digest

    lora = kept_adapter(name)
    if lora is None:
        return {"held": False, "kept": served_adapters()}
    tensors = served_lora_tensors(lora, worker.model_runner.get_model().lora_manager.packed_modules)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return {"held": True, "dtypes": dtypes, "digests": {key: tensor_digest(t) for key, t in tensors.items()}}


# Every question, by name. NOTE: each first-replica entry says why the first replica's answer is the whole server's.
QUESTIONS: dict[str, Question] = {
    q.name: q
    for q in (
        # Asked when a writer is built for a server on vLLM's own backend (NCCL), which has no gloo group, ever. Every
        # replica runs the same plugin in the same environment. (`ServerClient.engine_fixes`.)
        Question("engine_fixes", (), list[str], _engine_fixes, Route.FIRST_REPLICA),
        # Asked when a sync is planned, before its transfer is set up, on any backend. Workers at the same place of
        # different replicas hold the same cuts: the trainer keys them by place. (`ServerClient.shard_rules`.)
        Question("shard_rules", (), dict[str, Any], _shard_rules, Route.FIRST_REPLICA),
        # Asked when the trainer is built, before any transfer. A setting of the server's environment, which every
        # replica's processes share. (`ServerAdapters.kept_adapter_versions`.)
        Question("kept_versions", (), int, _kept_versions, Route.FIRST_REPLICA),
        # Asked after an adapter round, over its group: each replica built its own copy, and every one is checked.
        # (`ServerAdapters.adapter_digests`, for `SyncConfig(verify=True)`.)
        Question("adapter_digests", (str,), dict[str, Any], _adapter_digests, Route.EVERY_REPLICA),
    )
}


def _declared(name: str, args: Sequence[Any]) -> Question:
    """The question `name`, with `args` checked against its declaration.

    Raises:
        ValueError: no such question.
        TypeError: `args` are not the question's.
    """
    question = QUESTIONS.get(name)
    if question is None:
        raise ValueError(
            f"no question {name!r} is declared here (declared: {sorted(QUESTIONS)}): a question is declared in "
            "fsdp_sync.transfer.questions.QUESTIONS, which the trainer and the server must share (install the same "
            "fsdp-vllm-sync version on both)"
        )
    if len(args) != len(question.args) or not all(isinstance(a, t) for a, t in zip(args, question.args)):
        expected = ", ".join(t.__name__ for t in question.args)
        given = ", ".join(type(a).__name__ for a in args)
        raise TypeError(f"question {name!r} takes ({expected}); it was asked with ({given})")
    return question


def answer(worker: Any, name: str, args: list[Any], route: str) -> WorkerAnswer | bool:
    """`ASK_METHOD`, on every vLLM worker: answer the question `name` by its worker-side function, through `route`
    (the trainer's `Route` value): returned (first replica), or sent over the transfer group (every replica).

    NOTE: the route comes with the request rather than from this worker's table, so a worker always joins the
    group's gather when the trainer waits in it, even for a question it does not know (a server on another version).

    Raises:
        ValueError, TypeError: (first-replica route) an unknown question, or arguments that are not its own; any
            error of the answering function. vLLM answers the request with the error.
        RuntimeError: (every-replica route) this worker has no gloo transfer group to answer over. Any other error is
            sent to the trainer as the answer, so that the group's gather never waits for this worker.
    """
    from fsdp_sync.compat.engine_api import worker_tag

    tag = worker_tag(worker)
    match Route(route):
        case Route.FIRST_REPLICA:
            return {"worker": tag, "answer": _declared(name, args).answers(worker, *args)}
        case Route.EVERY_REPLICA:
            engine = getattr(worker, "weight_transfer_engine", None)
            group = getattr(engine, "group", None)
            if group is None:
                raise RuntimeError(
                    f"worker {tag or '?'} cannot answer {name!r} over the gloo transfer group: it has none (the "
                    "server's weight-transfer backend is not 'gloo', or no trainer called /init_weight_transfer_engine)"
                )
            try:
                sent: dict[str, Any] = {"worker": tag, "answer": _declared(name, args).answers(worker, *args)}
            except Exception as e:  # noqa: BLE001 - sent to the trainer, which raises it with every worker's
                sent = {"worker": tag, "error": f"{type(e).__name__}: {e}"}
            timeout = timedelta(seconds=engine.timeout_s)
            gather_to_sender(group, json.dumps(sent).encode(), lambda work: work.wait(timeout))
            return True


def install() -> bool:
    """Give vLLM's workers `ASK_METHOD` (idempotent). Returns whether it is installed; False on a vLLM without the
    worker class `/collective_rpc` calls methods of (`vllm.v1.worker.worker_base.WorkerBase` in vLLM 0.28-0.32).

    NOTE: a method on the class, not on each worker: the plugin runs in every vLLM process at its start, before the
    worker exists; nothing else of the worker is changed.
    """
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:
        return False
    setattr(WorkerBase, ASK_METHOD, answer)
    return True


# --- the trainer side ---------------------------------------------------------------------------------------------


class AsksServer(Protocol):
    """The server's `/collective_rpc` route (`fsdp_sync.server_client.ServerClient.collective_rpc`)."""

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]: ...


class AnswerGroup(Protocol):
    """The every-replica route's transport: the trainer's gloo transfer engine
    (`GlooTrainerWeightTransferEngine.gather_answers`)."""

    def gather_answers(self, request: Callable[[], Any], what: str) -> list[bytes]: ...


def ask(client: AsksServer, name: str, *args: Any, transfer: AnswerGroup | None = None) -> list[WorkerAnswer]:
    """Every answering worker's answer to the question `name` (`QUESTIONS`), through the route it declares: each
    worker of the first data-parallel replica, or of every replica (in transfer-rank order).

    Args:
        client: the server's client.
        name: the question; `args` its arguments.
        transfer: the trainer's gloo transfer engine; needed by (and only used for) questions answered over the
            group (`Route.EVERY_REPLICA`).

    Raises:
        ValueError: an undeclared question (nothing is asked), or one answered over the group without `transfer`.
        TypeError: arguments that are not the question's (nothing is asked); an answer that is not of the declared
            type (the server runs another version of this package).
        RuntimeError: (every-replica route) a worker could not answer (each such worker named, with its error).
        Whatever the client raises: the route's own failure (e.g. `ServerRequestError` where the server's workers
            lack `ASK_METHOD`: this package is not installed there).
    """
    question = _declared(name, args)
    match question.route:
        case Route.FIRST_REPLICA:
            answers = client.collective_rpc(ASK_METHOD, [name, list(args), question.route.value])
        case Route.EVERY_REPLICA:
            if transfer is None:
                raise ValueError(
                    f"question {name!r} is answered over the gloo transfer group (every worker of every data-parallel "
                    "replica): pass transfer=, the trainer's gloo transfer engine, once a sync has set it up"
                )
            request = [name, list(args), question.route.value]
            what = f"the workers' {name}"
            payloads = transfer.gather_answers(lambda: client.collective_rpc(ASK_METHOD, request), what)
            answers = [json.loads(p) for p in payloads]
    return _checked(question, answers)


def _checked(question: Question, answers: list[Any]) -> list[WorkerAnswer]:
    """The workers' answers, each of the question's declared type.

    Raises:
        RuntimeError: a worker answered with its error (each such worker named).
        TypeError: an answer not of the declared type (the server runs another version of this package).
    """
    name = question.name
    version = "the server runs another version of fsdp-vllm-sync than the trainer: install the trainer's version there"
    if not all(isinstance(a, dict) for a in answers):
        given = str(answers)[:200]
        raise TypeError(f"the server's workers answered {name} with {given}, not one answer each: {version}")
    failed = [f"{a.get('worker') or i}: {a['error']}" for i, a in enumerate(answers) if "error" in a]
    if failed:
        raise RuntimeError(f"the server's workers could not answer {name}: {'; '.join(failed)}")
    expected = typing.get_origin(question.answer) or question.answer
    wrong = [
        f"{a.get('worker') or i}: {type(a.get('answer')).__name__}"
        for i, a in enumerate(answers)
        if not isinstance(a.get("answer"), expected)
    ]
    if wrong:
        raise TypeError(
            f"the server's workers answered {name} with other than {question.answer} ({'; '.join(wrong)}): {version}"
        )
    return [{"worker": str(a.get("worker") or ""), "answer": a["answer"]} for a in answers]
