"""The kernel tests (`tests/unit/kernels/`) on a machine without CUDA: in a process of their own, under Triton's
interpreter.

Why a process of its own: Triton decides between its compiler and its interpreter when it is first imported, and
this process imported it already. The child must pass every kernel test and skip none, so this test cannot pass
without the kernels having run and matched their references.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.kernels import runtime

KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"


@pytest.mark.skipif(not runtime.triton_importable(), reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernel tests run on it, in this process")
def test_every_kernel_test_passes_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(KERNEL_TESTS), "-q", "-p", "no:cacheprovider", "-rs"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
    assert "skipped" not in summary and "deselected" not in summary, summary
