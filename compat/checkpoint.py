"""Read an engine manifest (names, shapes, dtypes) from the checkpoint the engine was started from.

Why the checkpoint: it is exactly what vLLM's loader accepted at start-up, in the names its `load_weights` expects,
and its headers give names, shapes and dtypes without reading any tensor data. The engine's own parameters cannot
serve: vLLM fuses them (`qkv_proj`) and its CPU backend repacks linear weights to size-0 parameters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .manifest import EngineManifest, TensorSpec

__all__ = ["read_checkpoint_manifest", "resolve_checkpoint_dir", "tied_word_embeddings"]

logger = logging.getLogger(__name__)

# Names vLLM's loaders skip on purpose when the model ties its output embedding to its input embedding.
TIED_OUTPUT_NAMES: tuple[str, ...] = ("lm_head.weight",)

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def resolve_checkpoint_dir(path_or_id: str | Path, revision: str | None = None) -> Path:
    """Return the local directory of a model given as a path or a hub id already in the local cache.

    Raises:
        FileNotFoundError: neither a directory nor a cached hub snapshot; names what was tried.
    """
    path = Path(path_or_id)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(path_or_id),
                revision=revision,
                local_files_only=True,
                allow_patterns=["*.json", "*.safetensors", "*.bin"],
            )
        )
    except Exception as e:  # huggingface_hub raises several types for "not cached"
        raise FileNotFoundError(
            f"Cannot find the checkpoint {path_or_id!r}: it is not a directory and not in the local Hugging Face "
            "cache. Pass the engine's model directory explicitly (SyncConfig(checkpoint_dir=...))."
        ) from e


def _read_safetensors_headers(files: list[Path]) -> dict[str, TensorSpec]:
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = handle.get_slice(name)
                specs[name] = TensorSpec(tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
    return specs


# Files next to the weights that are not weights (the same list vLLM's loader skips).
NON_WEIGHT_FILES: frozenset[str] = frozenset(
    {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
)
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _safetensors_files(directory: Path) -> list[Path]:
    """The shards the index lists when there is one (a folder may also hold a consolidated copy), else all files."""
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


def _read_torch_bins(files: list[Path]) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for f in files:
        # NOTE: map_location="meta" reads shapes and dtypes without materialising any tensor data.
        state = torch.load(str(f), map_location="meta", weights_only=True)
        specs.update({k: TensorSpec(tuple(v.shape), v.dtype) for k, v in state.items()})
    return specs


def _ties_embeddings(directory: Path) -> bool:
    """Whether the model ties its output embedding, with the per-model-class default where the key is absent."""
    config_path = directory / "config.json"
    if not config_path.exists():
        return False
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(directory))
    except (ImportError, ValueError, KeyError):  # no transformers, or a model type it does not know
        return tied_word_embeddings(json.loads(config_path.read_text()))
    # NOTE: transformers knows each class's default (True for Qwen2, False for Llama). It ties by the model's own
    # (top-level) config; a VLM's text sub-config may not have the attribute at all (Qwen2VLTextConfig, 5.19).
    for candidate in (config, config.get_text_config()):
        value = getattr(candidate, "tie_word_embeddings", None)
        if value is not None:
            return bool(value)
    return False


def tied_word_embeddings(config: dict) -> bool:
    """Whether a config ties the output embedding, at the top level or in its text sub-config (VLMs)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config") or {}
    # NOTE: transformers' default for PretrainedConfig.tie_word_embeddings is True.
    return bool(text.get("tie_word_embeddings", True))


def read_checkpoint_manifest(
    path_or_id: str | Path, *, engine_dtype: torch.dtype | None = None, revision: str | None = None
) -> EngineManifest:
    """Read names, shapes and dtypes of every tensor in a Hugging Face checkpoint directory.

    Args:
        path_or_id: the model directory (or cached hub id) the engine was started from.
        engine_dtype: the engine's compute dtype, recorded in the manifest for the cast.

    Raises:
        FileNotFoundError: no safetensors or `.bin` weights in the directory.
    """
    directory = resolve_checkpoint_dir(path_or_id, revision)
    safetensors_files = _safetensors_files(directory)
    if safetensors_files:
        tensors = _read_safetensors_headers(safetensors_files)
    else:
        bins = sorted(p for p in directory.glob("*.bin") if p.name not in NON_WEIGHT_FILES)
        if not bins:
            raise FileNotFoundError(f"No *.safetensors or *.bin weights in {directory}")
        tensors = _read_torch_bins(bins)
    optional = frozenset(TIED_OUTPUT_NAMES) if _ties_embeddings(directory) else frozenset()
    return EngineManifest(tensors=tensors, optional=optional, engine_dtype=engine_dtype, source=str(directory))
