"""The trainer's questions to a server's workers (`fsdp_sync.transfer.questions`): one declared table, one method on
the workers, one function that asks. Each question reaches the function its table entry names, through the route it
declares, and comes back tagged by worker; an undeclared question, arguments that are not a question's, and answers
of another type are refused with the offender named. No module asks the workers around the table.

The every-replica route over a real gloo group is in `test_server_writer.py`
(`test_every_worker_answers_over_the_transfer_group_even_where_the_route_answers_for_one`); here the group's gather is
a stand-in, so that every question runs through both ends in one process.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fsdp_sync.transfer import questions
from fsdp_sync.transfer.questions import ASK_METHOD, QUESTIONS, Route

ROOT = Path(__file__).resolve().parents[2]
TAGS = ["dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"]
# One value of each JSON type a question may take or answer.
SAMPLES: dict[type, Any] = {str: "v1", int: 3, float: 0.5, bool: True, list: ["a"], dict: {"k": None}}


def _workers() -> list[Any]:
    """vLLM workers as `/collective_rpc` finds them: instances of `WorkerBase` (built without a vLLM config), each
    with its `/weight_checker` prefix and a transfer engine holding a group."""
    from vllm.v1.worker.worker_base import WorkerBase

    class Worker(WorkerBase):
        pass

    workers = []
    for tag in TAGS:
        worker = object.__new__(Worker)
        worker._weight_checksum_prefix = lambda t=tag: t + ":"  # type: ignore[attr-defined]
        worker.weight_transfer_engine = SimpleNamespace(group=object(), timeout_s=5)  # type: ignore[attr-defined]
        workers.append(worker)
    return workers


class _Server:
    """`/collective_rpc` as vLLM serves it: the method, by name, on every worker; answered with each worker's result
    (the first data-parallel replica's alone: `first_replica_only`), results vLLM cannot send as JSON made strings."""

    def __init__(self, workers: list[Any], *, first_replica_only: bool = False) -> None:
        self.workers = workers
        self.first_replica_only = first_replica_only
        self.requests: list[tuple[str, list[Any]]] = []

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        self.requests.append((method, list(args or [])))
        results = [getattr(worker, method)(*(args or [])) for worker in self.workers]
        results = [r if r is None or isinstance(r, dict | list) else str(r) for r in results]
        return results[:1] if self.first_replica_only else results


class _Group:
    """The trainer's transfer engine for the every-replica route, with the workers' gather to it: what each worker
    sends (`gloo_wire.gather_to_sender`, patched in `questions`) is what `gather_answers` returns."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[bytes] = []
        monkeypatch.setattr(questions, "gather_to_sender", lambda group, payload, wait: self.sent.append(payload))

    def gather_answers(self, request: Any, what: str) -> list[bytes]:
        request()
        return list(self.sent)


def _sample(hint: Any) -> Any:
    return SAMPLES[typing.get_origin(hint) or hint]


def test_every_declared_question_is_well_formed() -> None:
    """Each entry: keyed by its name; its worker-side function takes the worker and exactly its arguments; its
    arguments and answer are JSON types (they travel in `/collective_rpc`'s body and over the group as JSON)."""
    assert set(QUESTIONS) == {"engine_fixes", "shard_rules", "kept_versions", "adapter_digests"}
    for name, question in QUESTIONS.items():
        assert question.name == name
        assert isinstance(question.route, Route)
        assert len(inspect.signature(question.answers).parameters) == 1 + len(question.args), name
        assert all(t in SAMPLES for t in question.args), name
        assert (typing.get_origin(question.answer) or question.answer) in SAMPLES, name
    # only the adapter's digests differ between data-parallel replicas (each built its own copy)
    assert {n for n, q in QUESTIONS.items() if q.route is Route.EVERY_REPLICA} == {"adapter_digests"}


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_each_question_is_installed_and_answered_by_its_worker_side_function(monkeypatch, name: str) -> None:
    """`install` gives vLLM's worker class the one method `/collective_rpc` calls; `ask` reaches the question's own
    worker-side function on every worker, with the question's arguments, through the route the table declares, and
    returns every answer tagged with its worker."""
    from vllm.v1.worker.worker_base import WorkerBase

    assert questions.install()
    assert getattr(WorkerBase, ASK_METHOD) is questions.answer
    question = QUESTIONS[name]
    calls: list[tuple[Any, ...]] = []

    def answers(worker: Any, *args: Any) -> Any:
        calls.append((worker, *args))
        return _sample(question.answer)

    monkeypatch.setitem(QUESTIONS, name, dataclasses.replace(question, answers=answers))
    workers = _workers()
    args = [_sample(t) for t in question.args]
    server = _Server(workers)
    transfer = _Group(monkeypatch) if question.route is Route.EVERY_REPLICA else None
    got = questions.ask(server, name, *args, transfer=transfer)
    assert calls == [(w, *args) for w in workers]
    assert got == [{"worker": tag, "answer": _sample(question.answer)} for tag in TAGS]
    assert server.requests == [(ASK_METHOD, [name, args, question.route.value])]


def test_the_worker_side_functions_answer_from_the_worker(monkeypatch) -> None:
    """The functions the table names, on a worker: the engine fixes applied (none before they are installed), the
    worker's cuts (`compat.tp_shards.shard_rules` of its model), the adapter versions it keeps, and the digests of an
    adapter version (none held here: the versions it keeps instead)."""
    from fsdp_sync.compat import lora_patches, tp_shards, vllm_patches

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    (worker, _) = _workers()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)  # type: ignore[attr-defined]

    def asked(name: str, *args: Any) -> Any:
        answer = questions.answer(worker, name, list(args), Route.FIRST_REPLICA.value)
        assert isinstance(answer, dict) and answer["worker"] == TAGS[0]
        return answer["answer"]

    monkeypatch.setattr(vllm_patches, "_ENGINES_FIXED", False)
    assert asked("engine_fixes") == []
    monkeypatch.setattr(vllm_patches, "_ENGINES_FIXED", True)
    assert asked("engine_fixes") == list(vllm_patches.ENGINE_FIXES)
    assert asked("shard_rules") == tp_shards.shard_rules(model) and set(asked("shard_rules")) == {
        "0.weight", "0.bias", "1.weight", "1.bias"
    }  # fmt: skip
    monkeypatch.setenv(lora_patches.ADAPTER_VERSIONS_ENV, "3")
    assert asked("kept_versions") == 3
    assert asked("adapter_digests", "never-pushed-v1") == {"held": False, "kept": lora_patches.served_adapters()}


def test_an_unknown_question_is_refused_on_both_ends(monkeypatch) -> None:
    """The trainer asks nothing for a question it does not declare; a worker refuses one it does not know (a server
    on another version), and over the group sends the refusal as its answer, so the trainer's gather never waits."""
    server = _Server(_workers())
    with pytest.raises(ValueError, match=r"no question 'digests' is declared here \(declared: \['adapter_digests'"):
        questions.ask(server, "digests")
    assert server.requests == []
    (worker, _) = _workers()
    with pytest.raises(ValueError, match="no question 'digests'"):
        questions.answer(worker, "digests", [], Route.FIRST_REPLICA.value)
    group = _Group(monkeypatch)
    assert questions.answer(worker, "digests", [], Route.EVERY_REPLICA.value) is True
    (sent,) = [json.loads(p) for p in group.sent]
    assert sent["worker"] == TAGS[0] and sent["error"].startswith("ValueError: no question 'digests'")


def test_arguments_that_are_not_the_questions_are_refused_before_anything_is_asked(monkeypatch) -> None:
    server = _Server(_workers())
    transfer = _Group(monkeypatch)
    with pytest.raises(TypeError, match=r"question 'adapter_digests' takes \(str\); it was asked with \(int\)"):
        questions.ask(server, "adapter_digests", 3, transfer=transfer)
    with pytest.raises(TypeError, match=r"question 'kept_versions' takes \(\); it was asked with \(str\)"):
        questions.ask(server, "kept_versions", "x")
    assert server.requests == [] and transfer.sent == []


def test_a_question_answered_over_the_group_is_refused_without_the_transfer() -> None:
    server = _Server(_workers())
    with pytest.raises(ValueError, match="'adapter_digests' is answered over the gloo transfer group.*pass transfer="):
        questions.ask(server, "adapter_digests", "v1")
    assert server.requests == []


def test_a_worker_without_the_transfer_group_refuses_to_answer_over_it() -> None:
    """A server on another backend, or before a trainer's handshake: the request fails (at once, for the trainer)."""
    (worker, _) = _workers()
    worker.weight_transfer_engine = None
    with pytest.raises(RuntimeError, match="worker dp0:pp0:pcp0:tp0 cannot answer 'adapter_digests'.*it has none"):
        questions.answer(worker, "adapter_digests", ["v1"], Route.EVERY_REPLICA.value)


def test_the_first_replica_route_answers_for_the_first_replica_only() -> None:
    """What vLLM's data-parallel client does (vLLM 0.32's `DPLBAsyncMPClient.call_utility_async`): the route the
    table declares for the questions whose answer every replica shares."""
    got = questions.ask(_Server(_workers(), first_replica_only=True), "engine_fixes")
    assert [a["worker"] for a in got] == TAGS[:1]


def test_answers_of_another_type_are_refused_naming_the_worker() -> None:
    """A server on another version of this package: its answers are not what the table declares."""

    class Old:
        def __init__(self, results: list[Any]) -> None:
            self.results = results

        def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
            return self.results

    wrong = r"kept_versions with other than <class 'int'> \(dp1:pp0:pcp0:tp0: str\).*install"
    with pytest.raises(TypeError, match=wrong):
        questions.ask(Old([{"worker": TAGS[0], "answer": 2}, {"worker": TAGS[1], "answer": "2"}]), "kept_versions")
    with pytest.raises(TypeError, match=r"answered kept_versions with \[2, 2\], not one answer each"):
        questions.ask(Old([2, 2]), "kept_versions")


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]


def test_no_module_asks_the_workers_around_the_table() -> None:
    """Only `questions` calls `/collective_rpc` (the client defines the generic call) and adds methods to vLLM's
    worker class. `fsdp_sync/_demo/` is the tests' own oracle, which reads the workers independently of the library."""
    own = ROOT / "fsdp_sync" / "transfer" / "questions.py"
    found: dict[str, list[str]] = {"collective_rpc": [], "WorkerBase": []}
    for base in (ROOT / "fsdp_sync", ROOT / "compat"):
        for path in base.rglob("*.py"):
            if path == own or "_demo" in path.relative_to(ROOT).parts:
                continue
            for call in _calls(path):
                func = call.func
                if isinstance(func, ast.Attribute) and func.attr == "collective_rpc":
                    found["collective_rpc"].append(f"{path.relative_to(ROOT)}:{call.lineno}")
                if isinstance(func, ast.Name) and func.id == "setattr" and "WorkerBase" in ast.unparse(call.args[0]):
                    found["WorkerBase"].append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found == {"collective_rpc": [], "WorkerBase": []}
    assert any(isinstance(c.func, ast.Attribute) and c.func.attr == "collective_rpc" for c in _calls(own))
