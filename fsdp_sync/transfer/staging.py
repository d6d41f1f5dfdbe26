"""Staging, a declared capability of a trainer-side transfer engine: rounds received by the server ahead of their
write, written together by `commit` (the writer calls it with the server paused).

Why a protocol: the writer that pauses a server for the write alone needs three things of the transport, and reads
nothing else of it: to ask it to stage (`staged`), to know whether staged rounds wait for their write (`pending`),
and to write them (`commit`) or forget them after a failure (`abandon`). A transport that cannot stage (vLLM's NCCL
engine) does not implement it; the writer decides once, from its table of transports, whether it stages.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["StagedTransfer"]


class StagedTransfer(Protocol):
    """A trainer-side transfer engine that can stage its rounds (the gloo backend's)."""

    staged: bool
    """Send every following round staged: received into the server's host memory, written only at `commit`."""

    @property
    def pending(self) -> bool:
        """Staged rounds were sent and neither committed nor abandoned (the server's update session is open)."""
        ...

    def commit(self) -> None:
        """Write every staged round into the engine and close the server's update session.

        Raises:
            whatever the server answered: a staged round that did not arrive whole leaves the engine unchanged.
        """
        ...

    def abandon(self) -> None:
        """Forget the staged rounds after a failure; the caller closes the server's session (which drops them)."""
        ...
