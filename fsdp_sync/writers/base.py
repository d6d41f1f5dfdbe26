"""The writer protocols, split by capability: what every transport does (`EngineWriter`: what the engine accepts,
what it says of its weights, the push), and what some can do besides (`PatchWriter`: sparse patches written in place;
`VersionedWriter`: weight versions; `BoundedWriter`: waits outside this process bounded by the sync's deadline;
`SharedWriter`: pushes every trainer rank sends a share of). The
sync checks the optional ones once, when it is built. The selection policies (`fsdp_sync.sync.delta`, `.sparse`) and
`verify` (`fsdp_sync.sync.verify`) are asked by the sync, never by a writer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from fsdp_sync.compat.engine_api import EngineLayout
from fsdp_sync.compat.lora_api import Adapter, EngineLoRA, LoRALimits
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch

__all__ = ["BoundedWriter", "EngineWriter", "PatchWriter", "SharedWriter", "VersionedWriter"]


class EngineWriter(Protocol):
    """Writes a stream of `(checkpoint_name, full_tensor)` into one inference engine.

    Attributes:
        kind: the transport, for reports (e.g. `"colocate:reload_weights"`).
        pushes: whether this rank writes at all. Ranks that do not push still gather (collectives) and drain.
        engine_dtype: the dtype tensors are cast to before the push (None: keep the trainer's).
        retains_tensors: whether the transport keeps references to tensors after taking the next one (vLLM's
            layer-wise reload buffers a layer's parts; the packed broadcast buffers a chunk). Then tensors whose
            storage the gatherer frees at the next unit are copied first; otherwise they are passed as they are.
        engine_per_rank: every rank writes into an engine of its own (colocate), so what is decided from the engine
            is known alike on every rank, and every rank receives the patches of a sparse sync; else only the pushing
            rank talks to the engine (server mode).
    """

    kind: str
    pushes: bool
    engine_dtype: torch.dtype | None
    retains_tensors: bool
    engine_per_rank: bool

    def manifest(self) -> EngineManifest:
        """What the engine accepts, by checkpoint name; read once, without touching engine weights."""
        ...

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Called once per plan with the tensors in stream order (transports that announce them first use it)."""
        ...

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push every tensor of the stream, in as few engine calls as the transport allows.

        Raises:
            SyncError: (a subclass) when the push stops part-way, for any reason (including a `StreamInterrupted`
                raised by the stream itself), with `engine` set to what the engine holds afterwards; the engine is
                left usable.
        """
        ...

    def finish(self) -> None:
        """After a complete push: drop state derived from the old weights (prefix cache)."""
        ...

    def engine_layout(self) -> EngineLayout:
        """Where the engine loads each checkpoint tensor and which of its modules own parameters (read once per
        plan, by the delta grouping and by `verify`)."""
        ...

    def engine_digests(self) -> tuple[dict[str, dict[str, str]], bool]:
        """The engine's own sha256 digests per parameter, per worker (`dp0:pp0:pcp0:tp0` as vLLM tags them; `""`
        for an engine without worker tags), and whether the engine shards weights over its workers (then each
        worker's digests are of its cut, compared through `EngineLayout.shard_rules`)."""
        ...


@runtime_checkable
class PatchWriter(Protocol):
    """A writer whose engine can take sparse patches in place (`SyncConfig(sparse=True)`)."""

    def sparse_refusal(self) -> str | None:
        """Why this engine cannot take sparse patches at all (None: it can), on the pushing rank."""
        ...

    def patch_refusals(self) -> dict[str, str]:
        """Engine parameter name -> why a patch cannot be written into it in place (read once per plan)."""
        ...

    def write_patches(self, patches: Sequence[EnginePatch]) -> None:
        """Write sparse patches into the engine in place (after `write` of the same sync, if any).

        Raises:
            SyncError: (a subclass) with `engine` set to what the engine holds afterwards.
        """
        ...


@runtime_checkable
class VersionedWriter(Protocol):
    """A writer whose engine can keep a weight version (`fsdp_sync.versions`): every successful push stamps one,
    and a delta or sparse sync first checks that the engine still holds the last (asked of the pushing ranks)."""

    def replaced(self) -> str | None:
        """Why the engine no longer holds the last push this writer stamped (both versions said), or None: it does,
        or the engine keeps no version (logged once)."""
        ...

    def stamp(self, version: str) -> str | None:
        """After a complete push: give the engine's weights `version`; returns the version as stamped (a writer may
        add a label; None: the engine keeps none). Raises only when the engine does not hold it afterwards."""
        ...


@runtime_checkable
class BoundedWriter(Protocol):
    """A writer with waits of its own outside this process (a server's answers, a network transfer), which end by
    the sync's deadline, so that an engine that stops answering fails the sync on every rank in time."""

    def bound(self, deadline: float) -> None:
        """Every wait of the sync starting now ends by `deadline` (`time.monotonic()`)."""
        ...


@runtime_checkable
class SharedWriter(Protocol):
    """A writer whose pushes every trainer rank sends a share of (a server's routed updates:
    `fsdp_sync.writers.server_routes`): the pushing rank plans each push (`route_ticket`), every rank takes the plan
    (`take_ticket`), and the ranks that do not push send their share (`share`) while the pushing one writes.

    Attributes:
        shares: decided once, when the writer is built, alike on every rank: whether its pushes are shared.
        sent_bytes: bytes this rank put on the wire in its last push (its share).
        worker_bytes: of them, what each of the engine's workers received from this rank, in worker order.
    """

    shares: bool
    sent_bytes: int
    worker_bytes: tuple[int, ...]

    def route_ticket(self) -> object | None:
        """On the pushing rank, after `prepare`: the plan of the next push, for every rank (None: not shared)."""
        ...

    def take_ticket(self, ticket: object | None) -> None:
        """On every rank: the pushing rank's plan of the next push."""
        ...

    def share(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """On a rank that does not push: send this rank's share of the stream (or drain it, without a plan)."""
        ...

    def route_failed(self) -> None:
        """On every rank, once the ranks agreed the push failed: forget the transfer (set up again at the next)."""
        ...


@runtime_checkable
class AdapterWriter(Protocol):
    """A writer into an engine that serves LoRA adapters: an adapter sync pushes the adapter's tensors alone into
    the engine's LoRA manager, in memory (`fsdp_sync.sync.adapter`), and leaves the engine's base as it was loaded."""

    def lora_limits(self) -> LoRALimits | None:
        """What the engine can serve as an adapter; None where it was started without LoRA."""
        ...

    def adapter_transport_refusal(self) -> str | None:
        """Why this writer's transport cannot carry an adapter to the engine (None: it can), on every rank alike."""
        ...

    def base_checkpoint(self) -> str:
        """The checkpoint directory the engine loaded its base weights from (checked once against the trainer's
        frozen base before the first adapter is written)."""
        ...

    def load_adapter(self, adapter: Adapter) -> None:
        """Build `adapter` in the engine from its tensors, beside the version generation is served (staged): no
        request names it yet, and the published version stays loaded."""
        ...

    def publish_adapter(self, adapter: Adapter) -> None:
        """The commit point of an adapter sync: the staged `adapter` becomes the version requests name; the
        previous one may then be unloaded (a server keeps its last K). Raises only when it did not happen (a
        writer that cannot tell reads the outcome back)."""
        ...

    def abandon_adapter(self) -> None:
        """After a failure before the commit: drop the staged version; the published one stays loaded and named
        (restored where loading the staged one evicted it)."""
        ...

    def adapter_request(self) -> object | None:
        """The `LoRARequest` (or, for a server, the name) of the adapter published last (None before the first)."""
        ...

    def adapter_digests(self) -> tuple[dict[str, dict[str, str]], EngineLoRA]:
        """The adapter staged last as the engine keeps it to serve, per worker (worker tag, `""` for an in-process
        engine -> `<module>.lora_a`/`.lora_b` ->
        sha256, `compat.lora_api.served_lora_tensors`), and how the engine builds an adapter (its LoRA dtype and
        names), for `SyncConfig(verify=True)`."""
        ...
