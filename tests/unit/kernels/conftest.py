"""The kernel tests run on CUDA where there is one, else on the CPU under Triton's interpreter.

Triton decides between its compiler and its interpreter when it is first imported (`TRITON_INTERPRET=1`), so on a
machine without CUDA these tests run in a process of their own started with that variable set
(`tests/unit/test_kernels_interpreted.py`); in any other process they are skipped (`support.needs_kernels`).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: CUDA, or the CPU under Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
