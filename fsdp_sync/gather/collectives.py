"""The collectives the flat gatherers share (FSDP1's in `fsdp1.py`, FSDP2's in `fsdp2.py`): one all-gather per FSDP
unit of the *local shards cast to the engine dtype*, the next unit's all-gather in flight while the current one is
pushed.

Why: on the measured CPU setup the all-gather dominates a sync (fp32 gather of the 36M model: 180 ms; the same
bytes in bf16: 71 ms). Casting is elementwise, so casting each shard before the gather gives bit-identical full
tensors to casting after it, while every rank casts only its own shard and the wire carries engine-dtype bytes.
Both backends' own unshard paths gather in the parameter dtype (FSDP2 in its mixed-precision `param_dtype`), so
the flat gatherers run the collective themselves, on the unit's process group, reading FSDP's sharding metadata.

Peak memory: the unit being pushed plus the next one being gathered, when that one is no larger than the configured
`prefetch_bytes` (the "bucket"); larger units are gathered after the push of the previous one.

Failures on one rank (docs/failures.md): `pipelined` runs the sync's status rounds (`Rounds`) around every unit. A
unit's all-gather starts only after every rank said its shard and output buffer are ready, and a gathered unit is
handed on only after every rank said its all-gather arrived; a failure anywhere on any rank (here, or downstream:
the mapping, the merge, the cast, the engine) stops every rank at the next round. So no rank waits in an all-gather
that another rank left, and no rank hands on a unit gathered with another rank's part missing: there are no
placeholder values. An all-gather call that raises after its round is joined again with a zero shard of the same
size (the other ranks are in it), and the unit is not handed on anywhere.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from fsdp_sync.compat.manifest import CASTABLE_DTYPES

from ..distributed import Rounds, collective
from ..errors import SyncTimeoutError
from ..faults import fault_point
from .base import sync_rounds

__all__ = ["FlatBase", "FlatOptions", "InFlight", "gather_dtype", "launch_or_join", "pipelined"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_P = TypeVar("_P")  # what `prepare` returns
_L = TypeVar("_L")  # what `launch` returns


def gather_dtype(dtype: torch.dtype, engine_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype on the wire: the engine's for castable floats (exact: the cast is elementwise), else its own."""
    if engine_dtype is not None and dtype in CASTABLE_DTYPES and engine_dtype in CASTABLE_DTYPES:
        return engine_dtype
    return dtype


@dataclass(frozen=True)
class FlatOptions:
    """What a flat gatherer is told, the same for both backends; `make_gatherer` builds it once per model.

    Attributes:
        engine_dtype: the engine's dtype, which castable floats travel in (`gather_dtype`); None: their own.
        keep_dtype: trainer names gathered in their own dtype rather than cast to the engine's first: what the PEFT
            merge computes with (base and adapter weights), so the merged weight is rounded to the engine dtype once,
            as PEFT's merge then a cast would. A flat parameter (FSDP1) holding any of them goes uncast whole.
        compute_device: where CPU-offloaded shards go before their all-gather (None: leave them).
        prefetch_bytes: the bucket: the next unit is gathered during the current push when it fits
            (`SyncConfig.prefetch_bytes`).
        timeout_s: the bound on the sync's status rounds and, on gloo, on each all-gather's wait
            (`SyncConfig.sync_timeout_s`); None: 600 s for the rounds, the process group's own for the waits.
    """

    engine_dtype: torch.dtype | None = None
    keep_dtype: Callable[[str], bool] | None = None
    compute_device: torch.device | None = None
    prefetch_bytes: int = 2**30
    timeout_s: float | None = None


# How long `InFlight.wait` lets gloo's worker thread drop its references to a finished all-gather's output.
_RELEASE_WAIT_S = 1.0


@dataclass
class InFlight:
    """One visit's all-gather: the output buffer and the handle to wait on.

    Attributes:
        settle: after the wait, hold on until the collective's own references to `out` are gone (gloo; see `wait`).
    """

    work: dist.Work | None
    out: torch.Tensor
    settle: bool = False

    def wait(self, timeout: datetime.timedelta | None) -> torch.Tensor:
        """The gathered buffer; `timeout` bounds the wait (gloo; None: the process group's own bound)."""
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                try:
                    self.work.wait(timeout)
                except RuntimeError as e:
                    raise SyncTimeoutError(
                        f"An all-gather of the weight sync did not complete within {timeout.total_seconds():g} s "
                        f"(SyncConfig.sync_timeout_s) on rank {dist.get_rank()}: {str(e).rstrip('.! ')}. Another rank "
                        "did not join it: "
                        "it is hung (e.g. still inside its engine push) or it died. The training process group "
                        "cannot be used any more; restart the job"
                    ) from e
            # NOTE: the Work holds the output until it is destroyed, and gloo's worker thread can still hold the Work
            # after `wait()` returns (measured on the first sync: the buffer was freed from that thread, after the
            # next unit's buffer was allocated: two units alive instead of one). Dropping the Work here and letting
            # the worker finish makes this rank's own release of the buffer the last one, so at most one unit is
            # alive at a time. Bounded: past the limit the buffer is released whenever gloo lets go of it.
            # `_use_count` (the C++ reference count) is the only way to see gloo's reference; it is private, hence
            # the guard.
            self.work = None
            if self.settle and hasattr(self.out, "_use_count"):
                deadline = time.monotonic() + _RELEASE_WAIT_S
                while self.out._use_count() > 1 and time.monotonic() < deadline:
                    time.sleep(0)
        return self.out


def _gloo() -> bool:
    """Whether the collectives run on gloo, whose worker thread may outlive `wait()` holding the output."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def _always(rounds: Rounds, work: Callable[[], _T]) -> _T | None:
    """`work()` even after this rank failed (it completes collectives the other ranks are in); an error is recorded
    and None returned (a timed-out wait ends the rounds: `Rounds.fail`)."""
    try:
        return work()
    except Exception as e:
        rounds.fail("gather", e)
        return None


def pipelined(
    visits: list[int],
    prepare: Callable[[int], _P],
    launch: Callable[[int, _P], _L],
    collect: Callable[[int, _L], list[tuple[str, torch.Tensor]]],
    sizes: list[int],
    limit: int,
    rounds: Rounds,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather and hand on each visit k, in the order of `visits`, with a status round before every launch and
    before every hand-off (see the module docstring).

    `prepare(k)` is this rank's own work before visit k's all-gather (its shard, its output buffer), `launch(k, p)`
    starts the collectives, `collect(k, l)` waits for them and returns the full tensors. When the next visit fits in
    `limit` bytes it is prepared while the current one is in flight, and one round then says both whether every
    rank's part of the current visit was real and whether every rank is ready for the next: that round travels while
    the current all-gather does (off the critical path), and the next all-gather runs during the current push.
    Larger visits are prepared after the push, behind a round of their own. Returns early, on every rank at the same
    round, once any rank has failed.
    """
    n = len(visits)
    if not n:
        return
    ready = rounds.attempt("gather", lambda: prepare(visits[0]))
    if not rounds.go_on():  # every rank's first shard and buffer are ready
        return
    launched = launch(visits[0], ready)  # type: ignore[arg-type]
    # NOTE: every reference to a unit's buffers is dropped as soon as it is no longer needed (the prepared shards,
    # the collected items): a buffer kept by this frame while the next unit is allocated would hold two at once.
    ready = None
    for i, k in enumerate(visits):
        following = visits[i + 1] if i + 1 < n else None
        early = following is not None and sizes[following] <= limit
        if early:
            ready = rounds.attempt("gather", lambda: prepare(following))  # type: ignore[arg-type]
        # This rank's part of visit k was real (its launch did not fall back to zeros), the next visit is ready,
        # nothing downstream failed: said while visit k's all-gather completes.
        started = rounds.start()
        items = _always(rounds, lambda: collect(k, launched))
        launched = None
        if not rounds.finish(started):
            return
        if early:
            launched = launch(following, ready)  # type: ignore[arg-type]
            ready = None
        for item in items or ():
            if rounds.failed:  # this rank's collect or its consumer failed: hand on nothing more (said next round)
                break
            yield item
            del item
        items = None
        if following is not None and not early:
            ready = rounds.attempt("gather", lambda: prepare(following))  # type: ignore[arg-type]
            if not rounds.go_on():
                return
            launched = launch(following, ready)  # type: ignore[arg-type]
            ready = None


def launch_or_join(
    rounds: Rounds,
    k: int,
    units: int,
    gathers: list[tuple[torch.Tensor, torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> list[dist.Work | None]:
    """Start one all-gather per `(output, local shard)` of visit k. A launch that raises is recorded, and it and the
    rest are joined with zero shards of the same size: every other rank has agreed to start them and is in them."""
    works: list[dist.Work | None] = []
    zeros = False
    for index, (out, local) in enumerate(gathers):
        if not zeros:
            try:
                fault_point("gather.launch", unit=k, units=units, index=index)
                works.append(
                    collective("gather.weights", dist.all_gather_into_tensor, out, local, group=group, async_op=True)
                )
                continue
            except Exception as e:
                rounds.fail("gather", e)
                zeros = True
        try:
            zero = torch.zeros_like(local)
            works.append(
                collective("gather.weights", dist.all_gather_into_tensor, out, zero, group=group, async_op=True)
            )
        except Exception as e:  # noqa: BLE001 - the first error is the one reported
            logger.error("weight sync: could not join an all-gather after a failed launch; the other ranks wait in "
                         "it until SyncConfig.sync_timeout_s: %s", e)  # fmt: skip
            works.append(None)
    return works


class FlatBase:
    """What both flat gatherers share: their options, the bound on waits, gloo's buffer settling, the status rounds."""

    def _init_flat(self, options: FlatOptions | None) -> FlatOptions:
        """Keep `options` (None: the defaults) and derive the bounds on waits; returns the options kept."""
        self.options = options = options if options is not None else FlatOptions()
        timeout_s = options.timeout_s
        self._settle = _gloo()
        self._timeout_s = 600.0 if timeout_s is None else timeout_s
        # NOTE: a bounded `wait(timeout)` is a blocking wait; on NCCL it would also make the host wait for the
        # device, so NCCL's waits keep their own bound (the process group's timeout and watchdog).
        bounded = self._settle and timeout_s is not None
        self._timeout = datetime.timedelta(seconds=timeout_s) if bounded else None
        return options

    def _rounds(self, rounds: Rounds | None) -> Rounds:
        return sync_rounds(rounds, self._timeout_s)
