"""Trainer parameter names -> Hugging Face checkpoint names, as pure functions over declared tables.

Why: vLLM's loaders expect checkpoint names (`model.layers.0.self_attn.q_proj.weight`), while a trainer sees names
decorated by every wrapper around the model: FSDP1 (`_fsdp_wrapped_module`), activation checkpointing
(`_checkpoint_wrapped_module`), `torch.compile` (`_orig_mod`), DDP (`module`) and PEFT (`base_model.model`,
`base_layer`, `modules_to_save.<adapter>`, adapter weights). Names are split on dots and whole segments are dropped,
never `str.replace`d, so a segment such as `my_orig_mod_layer` is never touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "ANYWHERE_WRAPPER_SEGMENTS",
    "LEADING_WRAPPER_SEGMENTS",
    "LORA_ADAPTER_SEGMENTS",
    "NON_ENGINE_HEADS",
    "NameRules",
    "Dropped",
    "canonical_name",
    "unwrapped_name",
]

# Segments that wrappers insert at any depth of the module tree.
ANYWHERE_WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {
        "_fsdp_wrapped_module",  # FSDP1 FullyShardedDataParallel
        "_checkpoint_wrapped_module",  # torch activation checkpointing (CheckpointWrapper)
        "_orig_mod",  # torch.compile (OptimizedModule)
    }
)

# Segments that wrappers insert only around the whole model. `module` is a legitimate submodule name in some models,
# so it is removed only as a leading segment (DDP / DataParallel), possibly after another leading wrapper.
LEADING_WRAPPER_SEGMENTS: frozenset[str] = frozenset({"module", "_orig_mod"})

# PEFT: the leading segments of a PeftModel (`base_model.model.`), removed as a pair.
PEFT_ROOT_PREFIX: tuple[str, str] = ("base_model", "model")
# PEFT: a tuner layer keeps the original layer as `base_layer`, and `trainable_token_indices` wraps the embedding in
# a `token_adapter`; the checkpoint name has neither segment.
PEFT_WRAPPER_SEGMENTS: frozenset[str] = frozenset({"base_layer", "token_adapter"})
# PEFT: `modules_to_save.<adapter>` holds the trained copy; `original_module` holds the frozen original.
PEFT_MODULES_TO_SAVE_SEGMENT = "modules_to_save"
PEFT_ORIGINAL_MODULE_SEGMENT = "original_module"

# Adapter weights of LoRA-family tuners (merged into the base weights before a push; never sent themselves). PEFT
# declares these per layer class as `adapter_layer_names`; `NameRules.for_model` extends this table from the model.
LORA_ADAPTER_SEGMENTS: frozenset[str] = frozenset(
    {
        "lora_A",
        "lora_B",
        "lora_embedding_A",
        "lora_embedding_B",
        "lora_magnitude_vector",  # DoRA
    }
)

# Heads that training adds and an inference engine does not have (value heads for PPO-style trainers, reward/score
# heads). Their parameters are dropped on purpose, and logged. Matched on the first segment of the canonical name.
NON_ENGINE_HEADS: frozenset[str] = frozenset({"v_head", "value_head", "score", "reward_head"})


@dataclass(frozen=True)
class Dropped:
    """A trainer parameter that is not sent on purpose, with the reason (logged once per structure)."""

    name: str
    reason: str


@dataclass(frozen=True)
class NameRules:
    """The tables one model's names are mapped with; build once per trainer.

    Attributes:
        adapter_segments: names of adapter weights (PEFT `adapter_layer_names`); parameters under them are dropped.
        non_engine_heads: first segments of heads the engine does not have; dropped and logged.
        peft: whether the model is a PEFT model (only then are PEFT segments interpreted).
    """

    adapter_segments: frozenset[str] = LORA_ADAPTER_SEGMENTS
    non_engine_heads: frozenset[str] = NON_ENGINE_HEADS
    peft: bool = False
    extra_wrapper_segments: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def for_model(cls, model: object, **overrides: object) -> NameRules:
        """Rules for `model`: PEFT detected from its tuner layers, with their declared adapter names added."""
        adapter_segments = set(LORA_ADAPTER_SEGMENTS)
        is_peft = False
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:  # PEFT not installed: no PEFT model can exist.
            BaseTunerLayer = None  # noqa: N806
        if BaseTunerLayer is not None:
            for module in model.modules():  # type: ignore[attr-defined]
                if isinstance(module, BaseTunerLayer):
                    is_peft = True
                    adapter_segments.update(module.adapter_layer_names)
        return cls(adapter_segments=frozenset(adapter_segments), peft=is_peft, **overrides)  # type: ignore[arg-type]


def _strip_wrappers(segments: list[str], rules: NameRules) -> list[str]:
    anywhere = ANYWHERE_WRAPPER_SEGMENTS | rules.extra_wrapper_segments
    start = 0
    while start < len(segments) and segments[start] in LEADING_WRAPPER_SEGMENTS:
        start += 1
    return [s for s in segments[start:] if s not in anywhere]


def _strip_peft(segments: list[str], rules: NameRules) -> list[str] | Dropped:
    name = ".".join(segments)
    if tuple(segments[:2]) == PEFT_ROOT_PREFIX:
        segments = segments[2:]
    if PEFT_ORIGINAL_MODULE_SEGMENT in segments:
        return Dropped(name, "PEFT original_module (the trained modules_to_save copy is sent instead)")
    if any(s in rules.adapter_segments for s in segments):
        return Dropped(name, "PEFT adapter weight (merged into its base weight for the push)")
    out: list[str] = []
    skip_next = False
    for s in segments:
        if skip_next:  # the adapter name after `modules_to_save`
            skip_next = False
            continue
        if s == PEFT_MODULES_TO_SAVE_SEGMENT:
            skip_next = True
            continue
        if s not in PEFT_WRAPPER_SEGMENTS:
            out.append(s)
    return out


def canonical_name(trainer_name: str, rules: NameRules = NameRules()) -> str | Dropped:
    """Map one trainer parameter name to its checkpoint name, or say why it is not sent.

    Examples:
        `_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight`
            -> `model.layers.0.self_attn.q_proj.weight`
        `module.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` (PEFT)
            -> `model.layers.0.self_attn.q_proj.weight`
    """
    segments = _strip_wrappers(trainer_name.split("."), rules)
    if rules.peft:
        stripped = _strip_peft(segments, rules)
        if isinstance(stripped, Dropped):
            return Dropped(trainer_name, stripped.reason)
        segments = stripped
    if segments and segments[0] in rules.non_engine_heads:
        return Dropped(trainer_name, f"head `{segments[0]}` has no counterpart in the inference engine")
    return ".".join(segments)


def unwrapped_name(trainer_name: str, rules: NameRules = NameRules()) -> str:
    """The trainer name without the segments wrappers insert (FSDP1, activation checkpointing, compile, DDP); PEFT's
    own segments are kept. The same parameter has one unwrapped name however the model is wrapped, so a name taken
    from the user's model matches one taken from the wrapped model the gatherer walks."""
    return ".".join(_strip_wrappers(trainer_name.split("."), rules))


def canonical_names(trainer_names: Iterable[str], rules: NameRules = NameRules()) -> dict[str, str | Dropped]:
    """`canonical_name` over many names, keyed by trainer name."""
    return {n: canonical_name(n, rules) for n in trainer_names}
