"""Sparse patches into the real vLLM CPU engine (`ColocateWriter.write_patches`), after a partial reload."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import run_engine_script

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("patch_identity.py")


def test_patches_after_a_partial_reload_land_and_the_engine_computes_as_with_whole_weights(tmp_path: Path) -> None:
    """Regression: a layer left out of a partial (delta) reload kept vLLM's deferring weight loader on its fused
    `qkv_proj.bias`, and the next sparse patch of it was dropped without a word."""
    result = run_engine_script(SCRIPT, str(tmp_path))
    assert len(result["whole"]) == 6 and result["patched"] > 0
    assert "model.layers.0.self_attn.qkv_proj.bias" in result["compared"]
    assert result["direct"] == result["patched"], "every tensor of this model lands in one contiguous run"
    assert result["differs"] == [], "engine parameters differ from the patched weights"
    assert result["differs_vllm_loader"] == [], "through vLLM's loader"
    # The GEMMs of patched layers were repacked: the engine computes as after a whole push of the same weights.
    assert result["logprobs_equal_whole"]
