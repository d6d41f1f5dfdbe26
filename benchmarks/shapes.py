"""Model shapes benchmarked: Qwen2-style, tied embeddings (as Qwen2 up to 7B)."""

from __future__ import annotations

from fsdp_sync._demo.models import TinySpec

# CPU (real vLLM CPU engine): about 36M and 150M parameters.
CPU_SHAPES: dict[str, TinySpec] = {
    "qwen2-36m": TinySpec(
        family="qwen2", hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=24576, tie_word_embeddings=True,
    ),
    "qwen2-150m": TinySpec(
        family="qwen2", hidden_size=1024, intermediate_size=2560, num_hidden_layers=11, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, vocab_size=32768, tie_word_embeddings=True,
    ),
}

# GPU (engine stand-in: preallocated buffers in vLLM's fused layout): Qwen2-1.5B and Qwen2-7B shapes.
GPU_SHAPES: dict[str, TinySpec] = {
    "qwen2-1.5b": TinySpec(
        family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    # Qwen2-7B's structure (28 layers, an untied head: 339 tensors; 1.5B's has 338) with tiny tensors: on CPU ranks the
    # sync's time is then its host work, which on the GPU bounds the complete sync at 1.5B (docs/benchmarks.md).
    # Untied: TRL 1.16's FSDP2 walk fails on this tied one on CPU ranks (a plain parameter where it wants a DTensor).
    "qwen2-layout": TinySpec(
        family="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=256, tie_word_embeddings=False,
    ),
    # A small shape to smoke-test the GPU benchmark's code on CPU ranks.
    "qwen2-smoke": TinySpec(
        family="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, tie_word_embeddings=False,
    ),
    "qwen2-7b": TinySpec(
        family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False,
    ),
}
