"""What a trainer family's seam can change (`TrainerSeam`), and the default, which changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import SyncConfig
    from ..report import SyncReport

__all__ = ["TrainerSeam", "WriterOptions"]


@dataclass(frozen=True)
class WriterOptions:
    """What a trainer family asks of the server writer (`writers.server.ServerWriter`'s options of the same names)."""

    pause_for_write: bool = False
    version_label: Callable[[], str] | None = None


class TrainerSeam:
    """The default: the trainer's own constructor, config and sync entry point, unchanged."""

    always_server = False

    def constructor_kwargs(
        self, bound: dict[str, Any], kwargs: dict[str, Any], close: Callable[[], None]
    ) -> dict[str, Any]:
        """The keyword arguments the trainer's constructor gets (`bound`: the call's arguments by name; `close`:
        closes this package's transfer to the server)."""
        return kwargs

    def sync_config(self, config: SyncConfig) -> SyncConfig:
        """The options this trainer family syncs with."""
        return config

    def writer_options(self, trainer: Any) -> WriterOptions:
        return WriterOptions()

    def adapter_refusal(self, trainer: Any, kept_versions: Callable[[], int] | None) -> str | None:
        """Why this trainer's generation cannot be served by adapter syncs (None: it can); asked on every rank
        when the adapter sync is built. `kept_versions`: the adapter versions the server keeps (None on a rank
        that does not talk to it, or colocated)."""
        return None

    def serve_adapter(self, trainer: Any, prefix: str) -> bool:
        """Make this trainer's generation ask for each adapter version (`<prefix>-v<N>`) itself; False: the mixin's
        default (TRL's generate calls in this process) applies."""
        return False

    def publisher(self, trainer: Any) -> Callable[[int | None], None] | None:
        """What this trainer moves when a sync commits (`fsdp_sync.sync.contract.PublishHook`: told the adapter version
        published, None for weights), run on every rank that learns it; None: nothing (the default)."""
        return None

    def sync(
        self, trainer: Any, run: Callable[[], SyncReport | None], last_pause: Callable[[], tuple[float, float] | None]
    ) -> None:
        """The trainer family's own sync entry point under the mixin (`run`: one sync of this package)."""
        run()
