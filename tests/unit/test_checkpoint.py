"""Unit tests for `compat.checkpoint`: the engine manifest read from a checkpoint directory's headers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest, resolve_checkpoint_dir, tied_word_embeddings
from fsdp_sync.compat.manifest import TensorSpec


def _write_config(directory: Path, config: dict) -> None:
    (directory / "config.json").write_text(json.dumps(config))


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(16, 8),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.zeros(16, 8),
    }


def test_single_safetensors_file(tmp_path: Path) -> None:
    """One safetensors file: every tensor's name, shape and dtype; the directory as source."""
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, {"tie_word_embeddings": False})
    manifest = read_checkpoint_manifest(tmp_path, engine_dtype=torch.bfloat16)
    assert dict(manifest.tensors) == {
        "model.embed_tokens.weight": TensorSpec((16, 8), torch.float32),
        "model.norm.weight": TensorSpec((8,), torch.float32),
        "lm_head.weight": TensorSpec((16, 8), torch.float32),
    }
    assert manifest.engine_dtype == torch.bfloat16
    assert manifest.source == str(tmp_path)
    assert manifest.optional == frozenset()


def test_path_given_as_str(tmp_path: Path) -> None:
    """A directory given as a string is read the same as a Path."""
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert set(read_checkpoint_manifest(str(tmp_path)).tensors) == {"a"}


def test_sharded_safetensors(tmp_path: Path) -> None:
    """Tensors from every shard are merged into one manifest."""
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {"model.norm.weight": torch.ones(8), "model.layers.0.w": torch.zeros(3, 5, dtype=torch.float16)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    manifest = read_checkpoint_manifest(tmp_path)
    assert dict(manifest.tensors) == {
        "model.embed_tokens.weight": TensorSpec((16, 8), torch.float32),
        "model.norm.weight": TensorSpec((8,), torch.float32),
        "model.layers.0.w": TensorSpec((3, 5), torch.float16),
    }


def test_bin_without_safetensors(tmp_path: Path) -> None:
    """With only a torch `.bin`, its tensors are read (shapes and dtypes); training_args.bin is ignored."""
    torch.save({"model.norm.weight": torch.ones(8), "model.idx": torch.arange(4)}, tmp_path / "pytorch_model.bin")
    torch.save({"not": "a state dict"}, tmp_path / "training_args.bin")
    manifest = read_checkpoint_manifest(tmp_path)
    assert dict(manifest.tensors) == {
        "model.norm.weight": TensorSpec((8,), torch.float32),
        "model.idx": TensorSpec((4,), torch.int64),
    }


def test_safetensors_preferred_over_bin(tmp_path: Path) -> None:
    """When both formats exist, only the safetensors files are read."""
    save_file({"from_safetensors": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    torch.save({"from_bin": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert set(read_checkpoint_manifest(tmp_path).tensors) == {"from_safetensors"}


def test_bf16_and_int_dtypes(tmp_path: Path) -> None:
    """bf16 and integer dtypes in the safetensors header map to the matching torch dtypes."""
    save_file(
        {"w": torch.zeros(4, 2, dtype=torch.bfloat16), "i": torch.zeros(3, dtype=torch.int32)},
        str(tmp_path / "model.safetensors"),
    )
    manifest = read_checkpoint_manifest(tmp_path)
    assert manifest.tensors["w"] == TensorSpec((4, 2), torch.bfloat16)
    assert manifest.tensors["i"] == TensorSpec((3,), torch.int32)


@pytest.mark.parametrize(
    ("config", "tied"),
    [
        ({"tie_word_embeddings": True}, True),
        ({"tie_word_embeddings": False}, False),
        ({}, True),  # transformers' default
        ({"text_config": {"tie_word_embeddings": False}}, False),
        ({"text_config": {"tie_word_embeddings": True}}, True),
        ({"text_config": {}}, True),
        ({"text_config": None}, True),
        # The top-level key wins over the text sub-config.
        ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, False),
        ({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}, True),
    ],
)
def test_tied_word_embeddings(config: dict, tied: bool) -> None:
    """Tying is read from the top-level config, else from `text_config`, else defaults to True."""
    assert tied_word_embeddings(config) is tied


@pytest.mark.parametrize(
    ("config", "lm_head_optional"),
    [
        ({"tie_word_embeddings": True}, True),
        ({"tie_word_embeddings": False}, False),
        ({"model_type": "qwen2"}, False),  # key absent: Qwen2Config's own default (False) applies
        ({"text_config": {"tie_word_embeddings": True}}, True),
        ({"text_config": {"tie_word_embeddings": False}}, False),
    ],
)
def test_lm_head_optional_when_tied(tmp_path: Path, config: dict, lm_head_optional: bool) -> None:
    """`lm_head.weight` is optional exactly when the config ties word embeddings."""
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, config)
    manifest = read_checkpoint_manifest(tmp_path)
    assert manifest.optional == (frozenset({"lm_head.weight"}) if lm_head_optional else frozenset())
    assert "lm_head.weight" in manifest.tensors  # still listed, so a sent lm_head is shape-checked


def test_vision_language_config_ties_at_the_top_level(tmp_path: Path) -> None:
    """Regression: transformers 5.19's Qwen2VLTextConfig has no `tie_word_embeddings` (the model ties by its top-level
    config); reading it from the text sub-config raised AttributeError and failed every Qwen2-VL sync."""
    from fsdp_sync._demo.models import build_tiny_vlm_checkpoint

    model_dir = build_tiny_vlm_checkpoint(tmp_path)
    assert read_checkpoint_manifest(model_dir).optional == frozenset({"lm_head.weight"})


def test_no_config_json_means_not_tied(tmp_path: Path) -> None:
    """Without config.json nothing says the embeddings are tied, so `lm_head.weight` stays required if present."""
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert read_checkpoint_manifest(tmp_path).optional == frozenset()


def test_tiny_checkpoint_manifest_matches_files(tmp_path: Path) -> None:
    """On a tiny qwen2 checkpoint the manifest equals the safetensors header and lm_head is optional (tied)."""
    from safetensors import safe_open

    from fsdp_sync._demo.models import build_tiny_checkpoint

    directory = build_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    manifest = read_checkpoint_manifest(directory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        expected = {n: TensorSpec(tuple(handle.get_tensor(n).shape), handle.get_tensor(n).dtype) for n in handle.keys()}
    assert dict(manifest.tensors) == expected
    assert manifest.optional == frozenset({"lm_head.weight"})


def test_directory_without_weights_raises(tmp_path: Path) -> None:
    """A directory with neither safetensors nor `.bin` weights raises FileNotFoundError naming it."""
    _write_config(tmp_path, {})
    torch.save({}, tmp_path / "training_args.bin")
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors or \\*.bin weights"):
        read_checkpoint_manifest(tmp_path)


@pytest.mark.parametrize("missing", ["does-not-exist-dir", "nobody-fsdp-sync-test/not-a-cached-model"])
def test_not_dir_nor_cached_hub_id_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """A path that is neither a directory nor a cached hub id raises FileNotFoundError, chained to the cause."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the relative name surely is not a directory here
    with pytest.raises(FileNotFoundError, match="not a directory and not in the local Hugging Face cache") as info:
        read_checkpoint_manifest(missing)
    assert repr(missing) in str(info.value)
    assert info.value.__cause__ is not None


def test_resolve_existing_directory_returned_as_is(tmp_path: Path) -> None:
    """An existing directory resolves to itself, without touching the hub cache."""
    assert resolve_checkpoint_dir(tmp_path) == tmp_path


def test_index_json_selects_files(tmp_path: Path) -> None:
    """With an index file, only the shards it lists make the manifest (as vLLM's loader does)."""
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"tok_embeddings.weight": torch.zeros(4, 2), "norm.weight": torch.ones(2)},
              str(tmp_path / "consolidated.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(read_checkpoint_manifest(tmp_path).tensors) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_optimizer_bin_ignored(tmp_path: Path) -> None:
    """A `.bin` checkpoint directory holding optimizer.bin gives the model's tensors only."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    optimizer.step()
    torch.save({"model.norm.weight": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    assert set(read_checkpoint_manifest(tmp_path).tensors) == {"model.norm.weight"}
