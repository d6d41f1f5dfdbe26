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

    def sync(
        self, trainer: Any, run: Callable[[], SyncReport | None], last_pause: Callable[[], tuple[float, float] | None]
    ) -> None:
        """The trainer family's own sync entry point under the mixin (`run`: one sync of this package)."""
        run()
