"""Test-side: TRL's async rollout loop, recording the model each request asks for (the demo's `--adapter` check).

Why a module of its own: TRL's `AsyncRolloutWorker` spawns its rollout process and pickles its loop class by name
(`_loop_cls`), so the recording class must be importable there; the file it appends to comes through the environment
the spawned process inherits (`NAMES_ENV`).
"""

from __future__ import annotations

import os

from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

__all__ = ["NAMES_ENV", "RecordingLoop"]

NAMES_ENV = "FSDP_VLLM_SYNC_TEST_ROLLOUT_NAMES"


class RecordingLoop(_AsyncRolloutLoop):
    """TRL 1.16's rollout loop, appending the model name of every request it sends to the file `NAMES_ENV` names."""

    @property
    def _request_model(self) -> str:
        name = super()._request_model
        path = os.environ.get(NAMES_ENV)
        if path:
            with open(path, "a") as names:
                names.write(name + "\n")
        return name
