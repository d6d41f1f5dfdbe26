"""The weight-transfer backends a server writer drives, and what each declares it can carry (`Transport`); the
check of a server before training; the stream as a backend that cannot end a round part-way takes it.

Why a table: the writer and the sync ask a transport what it can do (stage, abort a round, carry patches or an
adapter) instead of comparing backend names; a new backend is one entry here.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from fsdp_sync.compat.server_api import ServerInfo
from fsdp_sync.compat.trl_api import ServerAddress

from ..errors import EngineState
from ..server_client import ServerClient, ServerConfigError

__all__ = [
    "SUPPORTED_BACKENDS",
    "Transport",
    "check_server",
    "completed_with_placeholders",
    "local_address_towards",
    "transport_for",
    "upstream_marked",
]


@dataclass(frozen=True)
class Transport:
    """How to reach one weight-transfer backend from the trainer.

    Attributes:
        retains_tensors: the trainer engine keeps tensors it was handed until a chunk is complete (NCCL's packed
            producer concatenates a chunk's tensors lazily); gloo copies each into its chunk at once.
        init_fields: backend-specific fields of the trainer init info, from (master address, port, world size,
            buffer bytes, timeout, the sync's deadline).
        requires_cuda: the backend runs only on a CUDA trainer.
        partial_round: what the server's engine holds after a round that ended part-way.
        aborts_round: the backend can end a round part-way on the server's side (gloo's abort marker), so a failure
            of the trainer's own stream leaves the transfer usable; without it (vLLM's NCCL backend) the round is
            completed with placeholder tensors, which the server then holds (reported as undefined).
        patches_loaders: the backend's worker side applies this package's fixes of vLLM's loaders
            (`compat.vllm_patches`, e.g. gpt-oss's); without them, the tensors those fixes cover are refused.
        bounded: the trainer engine ends its own waits by the sync's deadline (`bound`); vLLM's NCCL engine keeps
            NCCL's bound on its collectives (the HTTP answers are bounded by the client either way).
        stages: the backend can receive an update into the server's host memory while the engine keeps generating
            and write it later (gloo's staged rounds), so a writer that pauses the server pauses it for the write
            alone; without it (NCCL) the server is paused for the whole send.
        carries_patches: the backend carries sparse patches, written in place on the server (sparse syncs); without
            it, every tensor goes whole.
        routes: the backend routes dense updates (`fsdp_sync.transfer.routes`): every trainer rank sends its share,
            and each worker receives only its cut; without it (NCCL) the sender sends every worker every tensor.
        carries_adapters: the backend carries a LoRA adapter into the server's LoRA manager, staged and then
            published (adapter syncs); without it, a LoRA model's adapter is merged into the weights pushed.
    """

    retains_tensors: bool
    init_fields: Callable[[str, int, int, int, float, float | None], dict[str, Any]]
    requires_cuda: bool
    partial_round: EngineState
    aborts_round: bool
    patches_loaders: bool
    bounded: bool
    stages: bool
    carries_patches: bool
    carries_adapters: bool
    routes: bool = False


_TRANSPORTS: dict[str, Transport] = {
    "nccl": Transport(
        retains_tensors=True,
        init_fields=lambda address, port, world, buffer, timeout, deadline: {
            "master_address": address,
            "master_port": port,
            "world_size": world,
            "packed": True,
            "packed_buffer_size_bytes": buffer,
        },
        requires_cuda=True,
        partial_round=EngineState(
            "undefined", note="vLLM's NCCL backend processes layers that received part of their weights from what they have"
        ),
        aborts_round=False,
        patches_loaders=False,
        bounded=False,
        stages=False,
        # NOTE: vLLM's own sparse_nccl backend is not driven yet; adapters go over this package's gloo rounds only.
        carries_patches=False,
        carries_adapters=False,
    ),
    "gloo": Transport(
        retains_tensors=False,
        init_fields=lambda address, port, world, buffer, timeout, deadline: {
            "master_address": address,
            "master_port": port,
            "world_size": world,
            "buffer_bytes": buffer,
            "timeout_s": timeout,
            "deadline": deadline,
        },
        requires_cuda=False,
        partial_round=EngineState(
            "mixed",
            note="the server's gloo backend gives layers that received part of their weights their previous ones back "
            "and logs which weights hold which",
        ),
        aborts_round=True,
        patches_loaders=True,
        bounded=True,
        stages=True,
        carries_patches=True,
        carries_adapters=True,
        routes=True,
    ),
}
SUPPORTED_BACKENDS: tuple[str, ...] = tuple(_TRANSPORTS)


def transport_for(info: ServerInfo) -> Transport:
    """The transport for the server's configured backend, decided once.

    Raises:
        ServerConfigError: the server has no weight-transfer backend, or one this writer does not drive, or one that
            needs CUDA on a trainer without it; says how to restart the server.
    """
    backend = info.weight_transfer_backend
    if backend is None:
        raise ServerConfigError(
            "The vLLM server was started without a weight-transfer backend, so weights cannot be sent to it. Restart "
            "it with --weight-transfer-config '{\"backend\": \"nccl\"}' (CUDA trainer and server) or "
            "'{\"backend\": \"gloo\"}' (any machine; needs fsdp-vllm-sync installed on the server), and "
            "VLLM_SERVER_DEV_MODE=1."
        )
    transport = _TRANSPORTS.get(backend)
    if transport is None:
        raise ServerConfigError(
            f"The vLLM server uses the weight-transfer backend {backend!r}; fsdp-vllm-sync supports "
            f"{list(SUPPORTED_BACKENDS)}. Restart the server with one of them."
        )
    if transport.requires_cuda and not torch.cuda.is_available():
        raise ServerConfigError(
            f"The vLLM server uses the {backend!r} weight-transfer backend, which needs CUDA on the trainer; this "
            "trainer has none. Restart the server with --weight-transfer-config '{\"backend\": \"gloo\"}'."
        )
    return transport


def check_server(address: ServerAddress, *, timeout_s: float) -> ServerInfo:
    """Wait for the server (up to the trainer's `vllm_server_timeout`) and check it can take weights.

    Raises:
        ServerUnavailableError: not up in time.
        ServerConfigError: no weight-transfer backend, an unsupported one, or no development routes.
    """
    client = ServerClient(address.base_url, timeout=timeout_s)
    client.wait_until_up(address.startup_timeout_s)
    info = client.server_info()
    transport = transport_for(info)
    if transport.patches_loaders:
        return info
    # NOTE: read on every rank, so that every rank's manifest refuses (or not) the same tensors.
    return dataclasses.replace(info, engine_fixes=client.engine_fixes())


def local_address_towards(base_url: str) -> str:
    """This host's address on the interface that routes to the server (what the server's workers connect to)."""
    host = urlparse(base_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


class UpstreamError(Exception):
    """Carries an exception raised by the sync's own stream through the transport's code, to tell it apart from
    the transport's failures."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def upstream_marked(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    it = iter(stream)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise UpstreamError(e) from e
        yield item


@dataclass
class Cut:
    """How a stream completed with placeholders was cut: its error and the announced tensors that were replaced."""

    error: Exception | None = None
    placeholders: list[str] = field(default_factory=list)


def completed_with_placeholders(
    stream: Iterator[tuple[str, torch.Tensor]], meta: list[Any], cut: Cut
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream; if it fails part-way, the rest of the announced tensors as placeholders (zeros, on the device of
    the last real tensor), so that a backend that cannot abort a round still completes it."""
    sent = 0
    device = torch.device("cpu")
    try:
        for name, tensor in stream:
            sent += 1
            device = tensor.device
            yield name, tensor
    except UpstreamError as e:
        cut.error = e.error
        for m in meta[sent:]:
            cut.placeholders.append(m.name)
            yield m.name, torch.zeros(m.shape, dtype=m.dtype, device=device)
