"""The errors a failed sync raises, on every rank, and what they carry.

Why one family: a sync runs collectives on every rank, so a failure anywhere must end it everywhere, at the same
point, with the same story. Whatever failed and wherever, every rank raises a `SyncError` whose message names each
failing rank, the stage it failed in and its original error, and says what state this rank's engine is in.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sync.compat.manifest import ManifestError as _CheckpointMismatch

__all__ = [
    "EngineState",
    "agreed_error",
    "describe_failures",
    "ManifestError",
    "NonFiniteWeightsError",
    "RankFailure",
    "RemoteSyncError",
    "StreamInterrupted",
    "SyncError",
    "SyncStageError",
    "SyncTimeoutError",
    "UnsupportedSetupError",
    "VerifyError",
]

# What a rank that writes into no engine says where others say what their engine holds.
NO_ENGINE = "This rank writes into no engine; the rank that writes says what the engine holds"


@dataclass(frozen=True)
class RankFailure:
    """What failed on one rank: the stage and the error, as text (it travels between ranks).

    Attributes:
        stage: where, in the order a sync runs them: `build` (the sync's first construction), `plan` (names and
            manifest, before anything is gathered), `version` (asking the engine which weight version it holds,
            before a delta or sparse sync), `check` (the non-finite or delta check of the local shards), `agree`
            (inside a control collective of the sync's own groups: an agreement or a status round), `patch` (the
            sparse round: diff, counts, patches, and their collectives), `gather` (this rank's part of the all-gathers), `map`, `merge`, `cast` (turning a
            gathered tensor into the engine's), `push` (the engine or the transport), `verify` (the optional
            read-back of the engine's digests), `publish` (the commit point: stamping the engine's weight version, or
            publishing the adapter version, last), `settle` (after a commit: the trainer's versions moving with it); an adapter sync's: `adapter.plan` (its plan and base check),
            `adapter.pieces` (this rank's adapter pieces and their exchange), `push`. docs/failures.md lists the
            fault points of each.
    """

    rank: int
    stage: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} ({self.stage}): {self.error}"


@dataclass(frozen=True)
class EngineState:
    """What one engine holds after a sync, as far as this rank knows it.

    Attributes:
        status: `"current"`: every weight of this sync is in. `"unchanged"`: nothing of this sync reached the engine;
            it holds exactly the previous weights. `"mixed"`: every engine weight holds either its previous or its
            new value, none is undefined; `previous` lists those still holding the previous one where the engine
            lets the writer see it. `"undefined"`: some weights may hold neither: those loaded from the checkpoint
            tensors in `undefined` where known, else any the push reached (the transport cannot tell).
            `"replaced"`: the engine holds weights this trainer did not send (its weight version says so: a
            restarted server holds its checkpoint). `"unknown"`: the engine could not be asked (a server that does
            not answer); `note` says what it holds once it answers again.
        previous: engine parameter names that still hold the previous sync's values.
        undefined: checkpoint tensor names whose engine weights hold undefined values.
        note: one sentence on how the writer knows.
        version: the version generation is served under: the engine's weight version as this trainer stamped it
            (`fsdp_sync.versions`), or the adapter version requests name (an adapter sync); None where this rank
            does not know one (nothing published yet, or an engine that keeps none).
    """

    status: str
    previous: tuple[str, ...] = ()
    undefined: tuple[str, ...] = ()
    note: str = ""
    version: str | None = None

    @property
    def current(self) -> bool:
        return self.status == "current"

    def describe(self, limit: int = 8) -> str:
        def listed(names: tuple[str, ...]) -> str:
            return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")

        match self.status:
            case "current":
                text = "holds every weight of this sync"
            case "unchanged":
                text = "holds exactly the weights it held before this sync (nothing of this sync reached it)"
            case "mixed":
                text = "holds a mix of previous and new weights, none undefined"
            case "replaced":
                text = "holds weights this trainer did not send"
            case "unknown":
                text = "could not be asked what it holds"
            case _:
                text = "may hold values that are neither the previous nor the new ones"
        if self.undefined:
            text += f"; the weights loaded from {len(self.undefined)} tensor(s) hold undefined values: {listed(self.undefined)}"
        if self.previous:
            text += f"; {len(self.previous)} engine weight(s) still hold the previous values: {listed(self.previous)}"
        if self.version is not None:
            text += f"; generation is served version {self.version}"
        return text + (f" ({self.note})" if self.note else "")


class SyncError(RuntimeError):
    """A weight sync failed. Raised on every rank at the same point, after every rank left the sync's collectives.

    Attributes:
        failures: every failing rank with its stage and error (filled in once the ranks have agreed).
        engine: this rank's engine state after the failure (None where this rank has no engine).
        landed: the sync had committed when the failure came (`fsdp_sync.sync.frame`, the commit point): its
            weights and version are in the engine, and the trainer's own versions (the async trainer's
            `model_version` and rollout worker) moved with them; the failure is a rank's, after that point.
    """

    def __init__(self, message: str, *, failures: tuple[RankFailure, ...] = (), engine: EngineState | None = None):
        super().__init__(message)
        self.failures = tuple(failures)
        self.engine = engine
        # Whether the message ends by saying what `engine` holds (`agreed_error`): said from `engine` when read, so
        # that it agrees with the failed `SyncReport` even where a caller filled `engine` in after the raise.
        self.says_engine = False
        # This rank writes into no engine (server mode: only the main process sends); set by the caller that knows.
        self.writes_no_engine = False
        self.landed = False

    def __str__(self) -> str:
        text = super().__str__()
        if getattr(self, "landed", False):
            text += (
                " This sync had committed before the failure: its weights and version landed in the engine, and "
                "the trainer's versions moved with them."
            )
        if not getattr(self, "says_engine", False):
            return text
        if getattr(self, "engine", None) is not None:
            text += f" This rank's engine {self.engine.describe()}."
        elif getattr(self, "writes_no_engine", False):
            text += f" {NO_ENGINE}."
        return text


class RemoteSyncError(SyncError):
    """The sync failed on another rank; this rank did its part and stops with the others."""


class SyncStageError(SyncError):
    """This rank's sync failed in one of its own stages (gather, name mapping, PEFT merge, conversion, cast); the
    original error is the cause."""


class SyncTimeoutError(SyncError):
    """A rank did not reach an agreed point of the sync within `SyncConfig.sync_timeout_s` (hung or dead). The ranks
    can no longer run collectives together; the job must be restarted."""


class ManifestError(SyncError, _CheckpointMismatch):
    """The sync plan does not match the engine's checkpoint (every unknown, missing and mismatched name is in the
    message); nothing was sent. Also a `fsdp_sync.compat.manifest.ManifestError` (a `ValueError`)."""


class UnsupportedSetupError(SyncError):
    """The trainer's set-up is one this package cannot sync (a TRL, vLLM or engine setting; the message says which
    and what to change). Raised on every rank when the trainer is built or at the first sync, before anything is
    gathered or sent."""


class NonFiniteWeightsError(SyncError):
    """`SyncConfig(check_finite=True)`: trainer weights hold NaN or Inf; nothing was sent."""


class VerifyError(SyncError):
    """`SyncConfig(verify=True)`: engine weights differ from what was sent."""


class StreamInterrupted(Exception):
    """Raised into a writer when the sync's own stream stops early (a failure upstream of the engine, recorded by
    the pipeline); a writer treats it as the end of a failed push, not as an engine failure."""


def describe_failures(failures: list[RankFailure]) -> str:
    return "; ".join(f.describe() for f in failures)


def agreed_error(
    local: Exception | None, failures: list[RankFailure], engine: EngineState | None, *, how: str = ""
) -> SyncError:
    """The one error every rank raises after a failed stage: this rank's own (its type kept where it is a
    `SyncError`; chained to it) or `RemoteSyncError`, naming every failing rank, stage and error, what happens next,
    and last what this rank's engine holds (from `engine` when the message is read: callers fill it in late).

    Args:
        how: how the ranks stopped, where not at a status round (said in place of the usual sentence).
    """
    parts = [f"The weight sync failed on {describe_failures(failures)}."]
    if how:
        parts.append(how)
    elif local is None:
        parts.append("This rank stopped with the others at the same point; no rank is left inside a collective.")
    parts.append("The next sync sends every weight.")
    message = " ".join(p for p in parts if p)
    if local is None:
        error: SyncError = RemoteSyncError(message, failures=tuple(failures), engine=engine)
    else:
        cls = type(local) if isinstance(local, SyncError) else SyncStageError
        error = cls(message, failures=tuple(failures), engine=engine)
        error.__cause__ = local
    error.says_engine = True
    return error
