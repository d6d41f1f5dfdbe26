"""Opt-in runtime verification (`SyncConfig(verify=True)`): after a push, the engine's own per-parameter sha256
digests are compared with digests of exactly what was sent, computed trainer-side in the engine's layout.

Why digests: they are what vLLM itself exposes for this (`Worker.compute_weight_checksums`, the server's
`/weight_checker` route: sha256 of each parameter's bytes), so the engine's weights never travel back. The engine
fuses some checkpoint tensors into one parameter (its model class's `packed_modules_mapping`, e.g.
`qkv_proj: [q_proj, k_proj, v_proj]`, concatenated along dim 0); the trainer-side digest of such a parameter hashes
the parts in that order, streaming, with no concatenated copy. A tensor-parallel worker's digest is of its cut of
a weight: the sent tensors are hashed as each worker's loader cuts them too (the cuts read from the workers' own
layers, `compat.tp_shards`), so every worker is compared. Where the engine cannot show a weight (vLLM-CPU repacks
linear layers to size 0; fused experts have no single sent counterpart; a sharded engine that cannot say how it
cuts), the weight is reported as unverifiable, by name, never passed silently.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming, worker_place
from fsdp_sync.compat.lora_api import Adapter, lora_model, served_lora_tensors
from fsdp_sync.compat.tp_shards import ShardRule

from ..digest import EMPTY_DIGEST, tensor_bytes, tensor_digest
from ..distributed import Coordinator, agreed
from ..errors import EngineState, RankFailure, SyncError, VerifyError, agreed_error
from ..faults import fault_point
from ..writers.base import AdapterWriter

__all__ = [
    "EMPTY_DIGEST",
    "EngineDigests",
    "VerifyResult",
    "compare_adapter",
    "tensor_bytes",
    "verify_adapter",
    "verify_push",
]

logger = logging.getLogger(__name__)


@dataclass
class VerifyResult:
    """The comparison of one sync's engine digests with what was sent.

    Attributes:
        checked: engine weights whose digest was compared.
        mismatched: engine weights whose digest differs from the sent bytes.
        moved: engine weights the loader transforms, checked to have changed with what was sent for them.
        stale: of those, the ones that kept their previous value although what was sent for them changed.
        drifted: engine weights this sync did not send (a delta or sparse sync) whose digest changed since the last
            verified sync (the unchanged ones are counted in `checked`).
        unverifiable: engine weight (or sent tensor) -> why it could not be compared.
    """

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    moved: int = 0
    stale: list[str] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    unverifiable: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.mismatched or self.stale or self.drifted)

    def describe(self, limit: int = 10) -> str:
        parts = []
        if self.mismatched:
            names = ", ".join(self.mismatched[:limit]) + (" ..." if len(self.mismatched) > limit else "")
            parts.append(
                f"{len(self.mismatched)} of {self.checked} engine weight(s) differ from what was sent: {names}. "
                "Something other than this sync wrote into the engine, or the engine's loader transformed the weights."
            )
        if self.stale:
            names = ", ".join(self.stale[:limit]) + (" ..." if len(self.stale) > limit else "")
            parts.append(
                f"{len(self.stale)} of {self.moved} engine weight(s) the loader transforms kept their previous value "
                f"although what was sent for them changed: {names}. The engine did not take them (a loader that "
                "bypasses vLLM's in-place reload leaves the old tensor with no error)."
            )
        if self.drifted:
            names = ", ".join(self.drifted[:limit]) + (" ..." if len(self.drifted) > limit else "")
            parts.append(
                f"{len(self.drifted)} engine weight(s) this sync did not send changed since the last verified sync: "
                f"{names}. Something other than this sync wrote into the engine."
            )
        return " ".join(parts)

    def describe_unverifiable(self, limit: int = 5) -> str:
        reasons: dict[str, list[str]] = {}
        for name, reason in self.unverifiable.items():
            reasons.setdefault(reason, []).append(name)
        parts = [
            f"{len(names)} ({reason}; e.g. {', '.join(sorted(names)[:limit])})" for reason, names in sorted(reasons.items())
        ]
        return f"verify: {self.checked} engine weight(s) checked; unverifiable: {'; '.join(parts)}"


# Engines may keep a 1-D 16-bit weight widened to float32: vLLM-CPU's small-GEMM kernel casts a linear layer's bias
# to float32 (`dispatch_cpu_unquantized_gemm`, measured on vLLM 0.32 with a bf16 engine: every `qkv_proj.bias` and
# `o_proj.bias` of the tiny test models). The widening is exact, so its digest is that of the sent values cast to
# float32, which is accepted as well. Only 1-D tensors (biases, norms: small) get this second hash.
_WIDENED = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_WHOLE: ShardRule = {"dim": None}


@dataclass
class _Fused:
    """The sent parts of one engine parameter, hashed in the engine's order as they arrive (and, for 1-D 16-bit
    parts, hashed again widened to float32)."""

    parts: int
    hasher: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    widened: "hashlib._Hash | None" = None
    next_part: int = 0
    early: dict[int, tuple[bytes, bytes | None]] = field(default_factory=dict)
    numel: int = 0

    def add(self, index: int, tensor: torch.Tensor) -> None:
        self.numel += tensor.numel()
        wide = _WIDENED.get(tensor.dtype) if tensor.dim() == 1 else None
        if index == 0 and wide is not None:
            self.widened = hashlib.sha256()
        widened = tensor_bytes(tensor.to(wide)) if wide is not None else None
        if index != self.next_part:  # arrived before a part that precedes it: keep its bytes until then
            self.early[index] = (bytes(tensor_bytes(tensor)), bytes(widened) if widened is not None else None)
            return
        self._update(tensor_bytes(tensor), widened)
        while self.next_part in self.early:
            self._update(*self.early.pop(self.next_part))

    def _update(self, data: memoryview | bytes, widened: memoryview | bytes | None) -> None:
        self.hasher.update(data)
        if self.widened is not None:
            if widened is None:
                self.widened = None  # a part that is not 1-D 16-bit: no widened form of the whole
            else:
                self.widened.update(widened)
        self.next_part += 1

    def pad(self, elements: int, itemsize: int) -> None:
        """Zeros after the last part (a worker's vocabulary cut, padded to its partition's rows)."""
        self.hasher.update(bytes(elements * itemsize))
        if self.widened is not None:
            self.widened.update(bytes(elements * 4))

    @property
    def complete(self) -> bool:
        return self.next_part == self.parts

    def matches(self, digest: str) -> bool:
        """Whether the engine's digest is that of the sent bytes (or of their exact float32 widening)."""
        if self.hasher.copy().hexdigest() == digest:
            return True
        return self.widened is not None and self.widened.copy().hexdigest() == digest


class EngineDigests:
    """Trainer-side digests of what one sync sends, per engine parameter, and what they show from sync to sync.

    Where the engine's loader transforms a tensor (gpt-oss's expert stacks, per-expert checkpoints fused into one
    experts tensor, then repacked by vLLM-CPU), no digest of the sent bytes can match the engine's. What can still be
    seen is whether the push reached it: where the model's loader, run dry (`EngineLayout.lands_in`), says which
    engine parameters a checkpoint tensor writes, a parameter whose sources changed since the last verified sync must
    have changed in the engine too. An unchanged digest there is a stale engine weight, reported like a mismatch (the
    kind of failure gpt-oss's reload showed: every parameter but the expert stacks and sinks updated, with no error).

    Where the engine shards weights over workers (tensor parallel), each worker holds its cut of a weight and its
    digest is of that cut: each sent tensor is also hashed as each distinct cut of the workers takes it
    (`EngineLayout.shard_rules`, read from the workers' own layers: `compat.tp_shards`), as it streams.

    Args:
        naming: where vLLM loads each checkpoint tensor (the model's renaming and `packed_modules_mapping`).
        transformed: checkpoint names the engine's loader transforms (`EngineLayout.transformed`).
        lands_in: checkpoint name -> engine parameters its load writes (`EngineLayout.lands_in`).
        shard_rules: worker place -> engine parameter -> its cut (`EngineLayout.shard_rules`); None: whole weights.
    """

    def __init__(
        self,
        naming: EngineNaming,
        *,
        transformed: frozenset[str] = frozenset(),
        lands_in: Mapping[str, tuple[str, ...]] | None = None,
        shard_rules: Mapping[str, Mapping[str, ShardRule | None]] | None = None,
    ) -> None:
        self._naming = naming
        self._transformed = transformed
        self._rules = shard_rules
        # (cut, engine parameter) -> the digest of what was sent for it, as that cut takes it ("": whole).
        self._entries: dict[tuple[str, str], _Fused] = {}
        # (cut, engine parameter) -> why the sent parts could not be hashed as that cut takes them.
        self._uncut: dict[tuple[str, str], str] = {}
        # engine parameter -> the distinct cuts the workers take of it (with shard rules only).
        self._cuts: dict[str, dict[str, ShardRule]] = {}
        # Engine parameter -> the checkpoint tensors its value is derived from, where that is not the tensor of its
        # own name (those are compared directly).
        self._sources_of: dict[str, list[str]] = {}
        for name, params in (lands_in or {}).items():
            if name in transformed or params != (naming.parameter(name)[0],):
                for param in params:
                    self._sources_of.setdefault(param, []).append(name)
        self._tracked = frozenset(n for names in self._sources_of.values() for n in names)
        # The names the tracked tensors would have by the renaming alone: not reported as missing from the engine.
        self._renamed_only = frozenset(naming.parameter(n)[0] for n in self._tracked)
        self._sent: dict[str, str] = {}
        self._sent_before: dict[str, str] = {}
        self._engine_before: dict[tuple[str, str], str] = {}
        # (worker, engine parameter) whose digest the last verified sync compared and found right.
        self._verified_before: frozenset[tuple[str, str]] = frozenset()
        self.seconds = 0.0

    @classmethod
    def of(cls, layout: EngineLayout) -> EngineDigests:
        """An empty digest set in an engine's layout (`EngineWriter.engine_layout`).

        Raises:
            Exception: the engine's own error where it cannot show its digests (nothing was sent yet).
        """
        if layout.no_digests is not None:
            raise layout.no_digests
        return cls(
            layout.naming,
            transformed=layout.transformed or frozenset(),
            lands_in=layout.lands_in,
            shard_rules=layout.shard_rules,
        )

    def reset(self) -> None:
        """Before each sync: nothing sent yet (what the last verified sync sent and found is kept)."""
        self._entries = {}
        self._uncut = {}
        self._sent = {}
        self.seconds = 0.0

    def forget(self) -> None:
        """After a failed sync: what the engine held before is no longer known."""
        self._sent_before = {}
        self._engine_before = {}
        self._verified_before = frozenset()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        if name in self._tracked:
            # Compared through the parameters it lands in (`_moved`), never byte for byte.
            self._sent[name] = tensor_digest(tensor)
        else:
            engine_name, index, parts = self._naming.parameter(name)
            for cut, rule in self._cuts_of(engine_name).items():
                if (cut, engine_name) not in self._uncut:
                    self._add_cut(cut, rule, engine_name, index, parts, tensor)
        self.seconds += time.perf_counter() - started

    def _cuts_of(self, engine_name: str) -> dict[str, ShardRule]:
        """The distinct cuts the engine's workers take of one parameter, by a key of the cut ("": whole)."""
        if self._rules is None:
            return {"": _WHOLE}
        cuts = self._cuts.get(engine_name)
        if cuts is None:
            cuts = {}
            for rules in self._rules.values():
                rule = rules.get(engine_name)
                if rule is not None:  # an unknown cut: reported per worker by `compare`
                    cuts[_cut_key(rule)] = rule
            self._cuts[engine_name] = cuts
        return cuts

    def _add_cut(self, cut: str, rule: ShardRule, engine_name: str, index: int, parts: int, tensor: torch.Tensor) -> None:
        """Hash part `index` of an engine parameter as one cut takes it: narrowed along the cut's dimension; the
        parts of a fused parameter concatenated, which streams only along dimension 0 (else reported)."""
        dim = rule["dim"]
        entry = self._entries.setdefault((cut, engine_name), _Fused(parts))
        if dim is None:
            entry.add(index, tensor)
            return
        (start, size), pad = rule["parts"][index], (rule.get("rows") or 0) - sum(s for _, s in rule["parts"])
        if len(rule["parts"]) != parts or (dim != 0 and (parts > 1 or pad > 0)):
            self._uncut[(cut, engine_name)] = (
                f"its workers' cut (along dim {dim}, {len(rule['parts'])} part(s), padded: {pad > 0}) is not one "
                "this check hashes as the parts stream"
            )
            return
        entry.add(index, tensor.narrow(dim, start, size))
        if entry.complete and pad > 0:
            entry.pad(pad * (tensor.numel() // max(tensor.shape[0], 1)), tensor.element_size())
    def _moved(self, worker: str, name: str, digest: str) -> bool | None:
        """Whether an engine parameter that cannot be compared directly changed as its sources did: True (it did),
        False (stale: its sources changed since the last verified sync and it did not), None (cannot tell)."""
        sources = self._sources_of.get(name)
        before = self._engine_before.get((worker, name))
        if not sources or before is None or not all(s in self._sent and s in self._sent_before for s in sources):
            return None
        if all(self._sent[s] == self._sent_before[s] for s in sources):
            return None  # nothing it is made of changed: unchanged is right, and proves nothing
        return digest != before

    def compare(self, workers: Mapping[str, Mapping[str, str]], *, sharded: bool = False) -> VerifyResult:
        """Compare with the engine's digests by engine parameter name, worker by worker.

        Args:
            workers: worker (`dp0:pp0:pcp0:tp0`, `""` untagged) -> engine parameter -> sha256 hex digest as vLLM
                computes it (of the worker's cut, where the engine shards weights).
            sharded: the engine shards weights over its workers: each worker's digests are compared with its cut
                (`shard_rules`); without rules for a worker, none of its weights can be compared.
        """
        result = VerifyResult()
        verified: set[tuple[str, str]] = set()
        for worker, engine in sorted(workers.items()):
            tag = f" (worker {worker})" if len(workers) > 1 else ""
            rules = (self._rules or {}).get(worker_place(worker)) if sharded else None
            for name, digest in sorted(engine.items()):
                cut = ""
                if sharded:
                    rule = rules.get(name) if rules is not None else None
                    if rule is None:
                        result.unverifiable[name + tag] = (
                            "the engine shards it over workers and did not say how (a server without this "
                            "package's gloo backend)"
                            if rules is None
                            else "the engine shards it with a layer whose cut this check does not know"
                        )
                        continue
                    cut = _cut_key(rule)
                entry = self._entries.get((cut, name))
                if (cut, name) in self._uncut:
                    result.unverifiable[name + tag] = self._uncut[(cut, name)]
                elif entry is None and (worker, name) in self._verified_before and name not in self._sources_of:
                    # Not sent by this (delta or sparse) sync: it must still hold what the last verified sync found.
                    if digest == self._engine_before[(worker, name)]:
                        result.checked += 1
                        verified.add((worker, name))
                    else:
                        result.drifted.append(name + tag)
                elif entry is None:
                    moved = self._moved(worker, name, digest)
                    if moved is not None:
                        result.moved += 1
                        if not moved:
                            result.stale.append(name + tag)
                    elif name in self._sources_of:
                        result.unverifiable[name + tag] = (
                            "the engine's loader transforms what is sent for it (transposed, sliced, stacked or a "
                            "converted layout), and its sources did not change since the last verified sync"
                        )
                    else:
                        result.unverifiable[name + tag] = "no single sent tensor corresponds to it (e.g. fused experts)"
                elif not entry.complete:
                    result.unverifiable[name + tag] = "only some of its fused parts were sent"
                elif digest == EMPTY_DIGEST and entry.numel > 0:
                    result.unverifiable[name + tag] = "the engine hides it (repacked to size 0, as vLLM-CPU does)"
                else:
                    result.checked += 1
                    if entry.matches(digest):
                        verified.add((worker, name))
                    else:
                        result.mismatched.append(name + tag)
        held = {name for engine in workers.values() for name in engine}
        for name in sorted({name for _, name in self._entries} - held - self._renamed_only):
            result.unverifiable[name] = "sent, but the engine reports no parameter of this name"
        if not result.failed:
            self._sent_before.update(self._sent)
            self._engine_before = {(w, n): d for w, engine in workers.items() for n, d in engine.items()}
            self._verified_before = frozenset(verified)
        return result


def _cut_key(rule: ShardRule) -> str:
    """A key that is the same for the same cut of any worker ("" for a whole weight)."""
    return "" if rule.get("dim") is None else json.dumps(rule, sort_keys=True)


def verify_push(
    coordinator: Coordinator,
    engine_digests: Callable[[], tuple[dict[str, dict[str, str]], bool]],
    digests: EngineDigests | None,
    pushed: EngineState | None,
) -> VerifyResult:
    """Compare the engine's own digests (`EngineWriter.engine_digests`) with what this rank sent (`digests`; None on
    a rank without an engine, which takes part in the agreement only); agreed on every rank.

    Args:
        pushed: this rank's engine state after the push (what it still holds unless its digests differ).

    Raises:
        VerifyError: on every rank, when any rank's engine differs from what it was sent.
    """

    def work() -> VerifyResult:
        if digests is None:
            return VerifyResult()
        fault_point("verify")
        workers, sharded = engine_digests()
        result = digests.compare(workers, sharded=sharded)
        if result.failed:
            raise VerifyError(result.describe())
        return result

    def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
        engine = pushed
        if isinstance(error, VerifyError):  # the weights named in its message differ from what was sent
            engine = EngineState("undefined", note="the engine's weights differ from what was sent")
        return agreed_error(error, failures, engine)

    return agreed(coordinator, "verify", work, failed)


def compare_adapter(expected: Mapping[str, str], workers: Mapping[str, Mapping[str, str]]) -> VerifyResult:
    """Compare the digests of an adapter as sent (`expected`: `<module>.lora_a`/`.lora_b` -> sha256, the scaling
    folded into `lora_b` as the engine folds it) with each worker's (or engine's) digests of the adapter it keeps
    (`workers`: worker tag -> digests)."""
    result = VerifyResult()
    for worker, held in sorted(workers.items()):
        tag = f" (worker {worker})" if len(workers) > 1 else ""
        for key in sorted(expected.keys() | held.keys()):
            if key not in held:
                result.mismatched.append(f"{key}{tag}: sent, but the engine's adapter has no such tensor")
            elif key not in expected:
                result.unverifiable[key + tag] = "the engine's adapter holds it in a layout no sent tensor maps to"
            else:
                result.checked += 1
                if held[key] != expected[key]:
                    result.mismatched.append(key + tag)
    return result


def verify_adapter(
    coordinator: Coordinator, writer: AdapterWriter, adapter: Adapter | None, staged: EngineState | None
) -> int:
    """`SyncConfig(verify=True)` for an adapter sync: the adapter version the engine staged (every worker of a
    server) against what this rank sent, digest for digest, before it is published; agreed on every rank. Returns
    the tensors compared.

    Why not the merged sync's digests: the engine's weights are untouched; what generation reads is the adapter's
    `lora_a`, and `lora_b` with the scaling folded in (`compat.lora_api.served_lora_tensors`). The expectation is
    built from the sent tensors by vLLM's own `LoRAModel.from_lora_tensors`, with the engine's LoRA dtype.

    Args:
        writer: the sync's `AdapterWriter` (`adapter_digests`).
        adapter: what this rank loaded; None on a rank without an engine (it takes part in the agreement only).
        staged: this rank's engine after the push (the staged version beside the one served).

    Raises:
        VerifyError: on every rank, when any rank's engine keeps other values than it was sent (the staged version
            is then dropped by the sync: requests keep naming the previous one).
    """

    def work() -> int:
        if adapter is None:
            return 0
        fault_point("verify")
        workers, engine = writer.adapter_digests()
        sent = served_lora_tensors(lora_model(adapter, engine), {})
        result = compare_adapter({key: tensor_digest(t) for key, t in sent.items()}, workers)
        if result.unverifiable:
            logger.warning("weight sync: %s", result.describe_unverifiable())
        if result.mismatched:
            names = ", ".join(result.mismatched[:10]) + (" ..." if len(result.mismatched) > 10 else "")
            raise VerifyError(
                f"{len(result.mismatched)} of the engine's adapter tensor(s) of {adapter.name} differ from what was "
                f"sent: {names}. Something other than this sync wrote into the engine's LoRA manager; "
                f"{adapter.name} is dropped unpublished."
            )
        return result.checked

    def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
        engine = staged
        if adapter is not None and staged is not None:
            engine = dataclasses.replace(
                staged,
                note=f"adapter {adapter.name}, loaded beside it, is dropped unpublished (it differs from what was "
                "sent where named): requests still name the previous version; the next sync loads the whole "
                "adapter again",
            )
        return agreed_error(error, failures, engine)

    return agreed(coordinator, "verify", work, failed)
