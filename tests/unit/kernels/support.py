"""What the kernel tests share: whether the kernels can run in this process."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.kernels import runtime

CUDA = torch.cuda.is_available()

# Every kernel test module sets `pytestmark = needs_kernels`.
needs_kernels = pytest.mark.skipif(
    not (runtime.triton_importable() and (CUDA or runtime.interpreting())),
    reason="needs CUDA, or Triton's interpreter from the start (tests/unit/test_kernels_interpreted.py runs it)",
)
