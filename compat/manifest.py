"""The manifest check: what a sync will send, against what the engine accepts, before the first byte is written.

Why: vLLM's in-place reload raises deep inside the engine on an unknown name, and by then it has already moved the
model's layers to the meta device (measured on vLLM 0.32: the engine is unusable afterwards). A name it does not
receive only logs a warning and leaves a stale weight. So every problem is found up front, from names, shapes and
dtypes alone, and reported in one error that lists every offender.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["EngineManifest", "ManifestError", "PlannedTensor", "TensorSpec", "check_plan"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a full (unsharded) tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a sync will send: its checkpoint name, full spec, and the trainer parameter(s) it comes from."""

    name: str
    spec: TensorSpec
    sources: tuple[str, ...]


@dataclass(frozen=True)
class EngineManifest:
    """What an engine accepts, in checkpoint names.

    Attributes:
        tensors: every checkpoint tensor the engine loads, with its shape and stored dtype.
        optional: names the engine accepts but does not need (e.g. `lm_head.weight` of a tied model, which vLLM
            skips); they are neither required nor reported as unknown.
        engine_dtype: the dtype the engine computes in; floating tensors are cast to it once before the push.
        source: where the manifest was read from, for error messages.
        refused: checkpoint names the engine accepts at start-up but cannot update in place, with the reason (its
            loader bypasses the in-place reload, or the engine released what a reload needs); a plan that sends any
            of them is refused before anything is written.
        wider: checkpoint names the engine loads into a parameter wider than `engine_dtype`, with that dtype
            (DeepSeek-V3's float32 `e_score_correction_bias` in a bf16 engine): sent uncast, as a cast to the engine
            dtype would round what a fresh load of the checkpoint keeps exact.
    """

    tensors: Mapping[str, TensorSpec]
    optional: frozenset[str] = field(default_factory=frozenset)
    engine_dtype: torch.dtype | None = None
    source: str = "engine"
    refused: Mapping[str, str] = field(default_factory=dict)
    wider: Mapping[str, torch.dtype] = field(default_factory=dict)


class ManifestError(ValueError):
    """The planned sync does not match the engine; nothing was written."""


# Dtypes the pipeline casts between (to the engine's dtype), as vLLM's loader does for a checkpoint stored in another
# float dtype. FP8 is storage of a quantized checkpoint (values meaningful only with their scales), not a cast target.
CASTABLE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _dtype_compatible(sent: torch.dtype, stored: torch.dtype) -> bool:
    if sent in CASTABLE_DTYPES and stored in CASTABLE_DTYPES:
        return True
    return sent == stored


def check_plan(plan: Iterable[PlannedTensor], manifest: EngineManifest) -> None:
    """Raise `ManifestError` listing every unknown, missing, duplicate, shape- and dtype-mismatched name.

    Args:
        plan: the tensors a sync will send, after name mapping and layout conversion.
        manifest: what the engine accepts.

    Raises:
        ManifestError: one error with every offender by class, and a hint.
    """
    by_name: dict[str, list[PlannedTensor]] = defaultdict(list)
    for item in plan:
        by_name[item.name].append(item)

    duplicates = {n: items for n, items in by_name.items() if len(items) > 1}
    unknown = sorted(n for n in by_name if n not in manifest.tensors and n not in manifest.optional)
    missing = sorted(n for n in manifest.tensors if n not in by_name and n not in manifest.optional)
    shape_bad: list[str] = []
    dtype_bad: list[str] = []
    for name, items in sorted(by_name.items()):
        expected = manifest.tensors.get(name)
        if expected is None:
            continue
        got = items[0].spec
        source = ", ".join(items[0].sources)
        if tuple(got.shape) != tuple(expected.shape):
            shape_bad.append(f"{name}: trainer {tuple(got.shape)} vs engine {tuple(expected.shape)}  (from {source})")
        if not _dtype_compatible(got.dtype, expected.dtype):
            dtype_bad.append(f"{name}: trainer {got.dtype} vs engine {expected.dtype}  (from {source})")

    problems: list[str] = []
    if unknown:
        lines = [f"  {n}  (from {', '.join(by_name[n][0].sources)})" for n in unknown]
        problems.append(f"{len(unknown)} name(s) the engine does not have:\n" + "\n".join(lines))
    if missing:
        problems.append(
            f"{len(missing)} engine weight(s) the trainer does not send (they would stay stale):\n"
            + "\n".join(f"  {n}" for n in missing)
        )
    if duplicates:
        lines = [f"  {n}  (from {', '.join(s for it in items for s in it.sources)})" for n, items in duplicates.items()]
        problems.append(f"{len(duplicates)} name(s) sent more than once:\n" + "\n".join(sorted(lines)))
    if shape_bad:
        problems.append(f"{len(shape_bad)} shape mismatch(es):\n" + "\n".join(f"  {s}" for s in shape_bad))
    if dtype_bad:
        problems.append(f"{len(dtype_bad)} dtype mismatch(es):\n" + "\n".join(f"  {s}" for s in dtype_bad))
    refused = sorted(n for n in by_name if n in manifest.refused)
    if refused:
        lines = [f"  {n}: {manifest.refused[n]}" for n in refused]
        problems.append(
            f"{len(refused)} tensor(s) this engine loads at start-up but cannot update in place (a sync would leave "
            "them stale):\n" + "\n".join(lines)
        )
    if problems:
        hints = []
        if len(problems) > len(refused[:1]):
            hints.append(
                "check that the engine was started from the same checkpoint as the trainer's model, and that wrapper "
                "or adapter names are covered by compat.names (run `fsdp-vllm-sync-check` on the model directory to "
                "print the full mapping)."
            )
        if refused:
            hints.append(
                "the tensors that cannot be updated in place are a limit of the installed vLLM for this model, not of "
                "the names: the reason is given for each (docs/architectures.md lists what is known per model)."
            )
        raise ManifestError(
            f"Weight sync plan does not match the engine ({manifest.source}); nothing was written.\n"
            + "\n".join(problems)
            + "\nHint: "
            + "\nHint: ".join(hints)
        )
