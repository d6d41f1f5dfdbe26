"""Run by `test_engine_reload.py` in a process of its own: a tiny gpt-oss on a real vLLM CPU engine (bf16) whose
expert stacks go through vLLM 0.32's own loader (`vllm_patches.load_gpt_oss_through_weight_loaders` keeps routing
the sinks, not the stacks), which copies them into the experts around the layer-wise reload, so a reload never
updates them: the failure gpt-oss syncs had, on the weights `verify` cannot compare byte for byte. Shows:

1. by default the first sync is refused before anything is written (the load probe sees the loader write those
   tensors around the reload), naming each of them; every engine tensor is unchanged;
2. with the manifest check off (`check_manifest=False`: what a user who turns the check off gets), the syncs run and
   the engine keeps its old experts; `verify=True` passes the first sync (nothing to compare the transformed experts
   with yet) and fails the second, naming the stale expert tensors: what was sent for them changed, they did not.

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    import fsdp_sync.compat.vllm_patches as vllm_patches
    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.errors import ManifestError, VerifyError
    from fsdp_sync.writers import ColocateWriter
    from fsdp_sync._demo.engine import engine_tensors, keep_engine_weights_readable
    from fsdp_sync._demo.models import build_tiny_checkpoint

    sys.path.insert(0, str(Path(__file__).parent))
    from architecture_sweep import engine, perturb

    keep_engine_weights_readable()
    vllm_patches._GPT_OSS_EXPERT_STACKS = ()  # expert stacks through vLLM's own loader
    base = build_tiny_checkpoint(out / "base", "gpt_oss")
    llm = engine(base)
    writer = ColocateWriter(llm)
    model = writer.handle.model
    # vLLM before 0.32 has no per-expert loading path for gpt-oss: the patch steps aside, and the sinks too go
    # through vLLM's own loader there.
    streamed = any(hasattr(type(m), "_get_streamed_expert_info") for m in model.modules())
    result: dict[str, object] = {"streamed_experts": streamed}

    trainer = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    before = engine_tensors(model)
    perturb(trainer, 0)
    try:
        build_sync(trainer, writer, SyncConfig(), device=torch.device("cpu")).sync()
        result["refused"] = None
    except ManifestError as e:
        result["refused"] = str(e)
    after = engine_tensors(model)
    result["changed_by_refused_sync"] = sorted(n for n in before if not torch.equal(before[n], after[n]))

    unchecked = build_sync(
        trainer, writer, SyncConfig(check_manifest=False, verify=True, delta=False), device=torch.device("cpu")
    )
    try:
        unchecked.sync()  # nothing to compare the transformed weights with yet: the first sync passes, stale
        result["first_verify_error"] = None
    except VerifyError as e:  # the sinks, compared byte for byte, where vLLM's own loader copies them too
        result["first_verify_error"] = str(e)
    stale_after_first = engine_tensors(model)
    result["stale_after_first"] = sorted(
        n for n in before if "routed_experts.w" in n and torch.equal(before[n], stale_after_first[n])
    )
    perturb(trainer, 1)
    try:
        unchecked.sync()
        result["verify_error"] = None
    except VerifyError as e:
        result["verify_error"] = str(e)
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
