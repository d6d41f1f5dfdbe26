"""Test-side oracle for "the server is paused only around the write": the server's own `GET /is_paused`, polled from
a thread of the trainer's main process during a whole sync, against the times that process moved the sync's data
(the weight all-gathers and patch gathers of the training group, the broadcasts and routed sends to the server).

Why from outside: the writer's own timers (`last_pause`) only time the pause the writer asked for; a writer that
silently paused over the send would still report a short pause around its own block. Here the server says when it
was paused, and torch says when the data moved; the library is not asked.

NOTE: each data collective is held `hold_s` before it runs (test-side), so that polls of a loaded server (tens of ms
each) are answered while the data moves: a tiny model's whole send is one broadcast of a few milliseconds, which no
poll would fit inside. What the server says during the hold is what it says during the send: the library has called
the collective and waits for it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# The sync's collectives that move its data (by the name `fsdp_sync.distributed.collective` gives each call); the
# status rounds and agreements are control and may run while the server is paused (after the write).
DATA_COLLECTIVES = frozenset({"gather.weights", "patch.counts", "patch.gather"})


class _TimedWork:
    """An async collective's work: the window ends when a wait for it returns."""

    def __init__(self, work: Any, window: list[float]) -> None:
        self._work = work
        self._window = window

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._window[1] = max(self._window[1], time.perf_counter())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class PauseWatch:
    """Polls `GET {base_url}/is_paused` without pause while open, and times this process's data collectives.

    Use as a context manager around one sync (`_sync_weight`); `summary()` says what the server was seen doing.
    """

    def __init__(self, base_url: str, *, hold_s: float = 0.3) -> None:
        self.url = f"{base_url}/is_paused"
        self.hold_s = hold_s
        # (sent, answered, paused) of every poll: the server's answer was true at some moment between the two.
        self.samples: list[tuple[float, float, bool]] = []
        # [start, end] of every data collective and broadcast to the server this process ran.
        self.windows: list[list[float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restore: list[Callable[[], None]] = []

    # --- timing the data ---------------------------------------------------------------------------------------------

    def _timed(self, original: Callable[..., Any], *, named: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if named:
                caller = sys._getframe(1)
                name = caller.f_locals.get("name") if caller.f_code.co_name == "collective" else None
                if name not in DATA_COLLECTIVES:
                    return original(*args, **kwargs)
            window = [time.perf_counter(), 0.0]
            self.windows.append(window)
            time.sleep(self.hold_s)
            result = original(*args, **kwargs)
            window[1] = time.perf_counter()
            return _TimedWork(result, window) if result is not None else result

        return timed

    def _install(self) -> None:
        import torch.distributed as dist

        for fn in ("all_gather_into_tensor", "gather", "all_gather"):
            original = getattr(dist, fn)
            setattr(dist, fn, self._timed(original, named=True))
            self._restore.append(lambda fn=fn, original=original: setattr(dist, fn, original))
        # NOTE: the transfer to the server broadcasts on its own gloo group's method (`group.broadcast`), not through
        # torch.distributed's functions; every chunk of every round is one such call on the sending rank. A routed
        # round sends each chunk point to point (`group.send`), from every trainer rank.
        for method in ("broadcast", "send"):
            original_method = getattr(dist.ProcessGroupGloo, method)
            setattr(dist.ProcessGroupGloo, method, self._timed(original_method, named=False))
            self._restore.append(
                lambda method=method, original=original_method: setattr(dist.ProcessGroupGloo, method, original)
            )

    # --- polling the server ------------------------------------------------------------------------------------------

    def _poll(self) -> None:
        import requests

        with requests.Session() as session:
            while not self._stop.is_set():
                sent = time.perf_counter()
                try:
                    paused = bool(session.get(self.url, timeout=10).json()["is_paused"])
                except Exception as e:  # noqa: BLE001 - a poll that got no answer says nothing; counted
                    self.errors.append(f"{type(e).__name__}: {e}")
                    continue
                self.samples.append((sent, time.perf_counter(), paused))

    def __enter__(self) -> PauseWatch:
        self._install()
        self._thread = threading.Thread(target=self._poll, name="pause-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def summary(self) -> dict[str, Any]:
        """What the server said during the sync, against the span in which this process moved data:
        `paused_before_data_end` polls said paused and were answered before the span ended (the server was paused
        at a moment before the data had moved: within one sync nothing may pause it before its write);
        `during_data` polls were answered wholly inside the span (`paused_during_data` of them said paused);
        `paused` polls said paused at all (the write's pause, seen)."""
        windows = [(a, b) for a, b in self.windows if b > 0]
        if not windows:
            return {"windows": 0, "polls": len(self.samples), "unanswered": len(self.errors), "errors": self.errors[:3]}
        start, end = min(a for a, _ in windows), max(b for _, b in windows)
        inside = [p for sent, answered, p in self.samples if start <= sent and answered <= end]
        paused = [(sent, answered) for sent, answered, p in self.samples if p]
        return {
            "windows": len(windows),
            "data_seconds": end - start,
            "polls": len(self.samples),
            "during_data": len(inside),
            "paused_during_data": sum(inside),
            "paused": len(paused),
            "paused_before_data_end": sum(1 for _, answered in paused if answered <= end),
            "unanswered": len(self.errors),
            "errors": self.errors[:3],
        }
