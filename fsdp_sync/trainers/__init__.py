"""One adapter per TRL trainer family whose sync is more than one call: where the sync is called, how pause,
resume and policy versions map (the mixin wires them; GRPO/RLOO's `vllm_generation.sync_weights` and
`_move_model_to_vllm` need none)."""
