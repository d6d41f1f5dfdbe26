"""`compat.engine_api`: the in-place reload is recognised by its signature, not by its name alone."""

from __future__ import annotations

from typing import Any

from fsdp_sync.compat.engine_api import _takes_weights_iterator


class OldWorker:
    """vLLM < 0.16: `reload_weights()` re-read the checkpoint from disk and took no argument."""

    def reload_weights(self) -> None: ...


class Runner:
    def reload_weights(self, weights_iterator: Any = None, weights_path: Any = None, is_checkpoint_format: bool = True) -> None: ...


class ForwardingWorker:
    """vLLM 0.32's worker: a generic signature that forwards to its model runner's."""

    def __init__(self, runner: Any) -> None:
        self.model_runner = runner

    def reload_weights(self, *args: Any, **kwargs: Any) -> None: ...


def test_old_argument_free_reload_is_not_taken_for_the_in_place_one() -> None:
    assert not _takes_weights_iterator(OldWorker().reload_weights)
    assert not _takes_weights_iterator(ForwardingWorker(OldWorker()).reload_weights)
    assert not _takes_weights_iterator(None)


def test_in_place_reload_found_directly_or_through_the_runner() -> None:
    assert _takes_weights_iterator(Runner().reload_weights)
    assert _takes_weights_iterator(ForwardingWorker(Runner()).reload_weights)


def test_installed_vllm_worker_has_the_in_place_reload() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)
    worker.model_runner = GPUModelRunner.__new__(GPUModelRunner)
    assert _takes_weights_iterator(worker.reload_weights)
