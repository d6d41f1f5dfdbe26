"""Tiny causal LMs and tokenizers built from configs, written as local Hugging Face checkpoints.

Why: tests and the demo must run with no hub access. Every model here is small but keeps the shapes vLLM's CPU backend
accepts (head_dim 64; head_dim 16 is rejected by its attention kernel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["FAMILIES", "TinySpec", "build_tiny_checkpoint", "build_tokenizer", "config_for", "read_checkpoint"]

# A small word-level vocabulary: enough distinct tokens for prompts and completions to vary.
_WORDS = (
    "the a an of to and in is it you that he was for on are with as I his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said each she which do their time if "
    "will way about many then them write would like so these her long make thing see him two has look more day could "
    "go come did number sound no most people my over know water than call first who may down side been now find"
).split()
_SPECIAL = ["<pad>", "<eos>", "<unk>"]


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model; defaults give about 0.4M parameters."""

    family: str = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    vocab_size: int = 512
    tie_word_embeddings: bool = True
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64


def config_for(spec: TinySpec):
    """The transformers config of a tiny spec."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        dtype="float32",
    )
    match spec.family:
        case "qwen2" | "llama" | "qwen3":
            return AutoConfig.for_model(spec.family, **common)
        case "qwen3_moe":
            return AutoConfig.for_model(
                "qwen3_moe",
                num_experts=spec.num_experts,
                num_experts_per_tok=spec.num_experts_per_tok,
                moe_intermediate_size=spec.moe_intermediate_size,
                decoder_sparse_step=1,
                norm_topk_prob=True,
                **common,
            )
        case _:
            raise ValueError(f"Unknown tiny model family {spec.family!r}; valid: {sorted(FAMILIES)}")


FAMILIES: dict[str, TinySpec] = {
    "qwen2": TinySpec(family="qwen2", tie_word_embeddings=True),
    "llama": TinySpec(family="llama", tie_word_embeddings=False),
    "qwen3": TinySpec(family="qwen3", tie_word_embeddings=True),
    "qwen3_moe": TinySpec(family="qwen3_moe", tie_word_embeddings=False),
}


def build_tokenizer(out_dir: str | Path):
    """Train a small byte-level BPE tokenizer on a built-in word list, write it, and return it (no hub).

    Why byte-level BPE: transformers 5 picks the tokenizer class from the model type (Qwen2Tokenizer for the Qwen
    families) and rebuilds the pre-tokenizer pipeline from its own definition, so only a vocabulary of the kind that
    class expects round-trips; vLLM loads the same files the same way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(0, len(_WORDS), 7)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_checkpoint(
    out_dir: str | Path, spec: TinySpec | str = "qwen2", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Write config, safetensors weights and tokenizer of a tiny model to `out_dir` and return the path.

    The tokenizer's vocabulary is smaller than the model's `vocab_size`; the extra rows are ordinary weights.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(spec, str):
        spec = FAMILIES[spec]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(spec), dtype=dtype)
    model.save_pretrained(str(out))
    (out / "tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=1))
    return out


def read_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in a checkpoint directory, by name."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state
