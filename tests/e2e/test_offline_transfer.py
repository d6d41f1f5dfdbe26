"""vLLM's offline weight-transfer contract against this package's gloo backend (real vLLM CPU engine, in-process).

Issue 39: running vLLM's offline weight-transfer tests against the gloo backend, a tied-embedding Qwen2's engine
seemed not to generate from the weights sent. Measured: with the tie intact, it does (its logprobs equal the
trainer's model's); a trainer whose tie was broken (its embedding assigned a new parameter, so vLLM's `ModuleSource`
also sends the stale `lm_head.weight`) had its new embedding silently overwritten by the stale head, the update
reporting success. That update is now refused, naming both tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import run_engine_script

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("offline_transfer.py")


def test_the_offline_llm_generates_from_the_weights_sent_and_refuses_a_broken_tie(tmp_path: Path) -> None:
    result = run_engine_script(SCRIPT, str(tmp_path))
    assert result["random_error"] is None, result["random_error"]
    assert result["random_embedding_equal"], "the engine's tied embedding is not the one sent"
    assert result["random_moved"] > 0.1, "the new embedding did not change the engine's logprobs"
    # float32 engine against the Hugging Face model of the same weights: ~5e-7 measured.
    assert result["random_worst_against_hf"] < 1e-3, result["random_worst_against_hf"]
    assert result["again_error"] is None, result["again_error"]
    assert result["again_embedding_equal"] and result["again_logprobs_equal"], "a send of unchanged weights moved"
    error = result["untied_error"]
    assert error is not None, "an update holding two values for one tied engine tensor was accepted"
    assert "'model.embed_tokens.weight' and 'lm_head.weight'" in error and "tie_word_embeddings" in error, error
    assert not result["untied_embedding_sent"]
    assert result["retied_error"] is None, result["retied_error"]
    assert result["retied_embedding_equal"]
    assert result["retied_worst_against_hf"] < 1e-3, result["retied_worst_against_hf"]
