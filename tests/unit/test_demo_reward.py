"""The demo job's reward, which the e2e jobs train on: a step moves weights only where a group's rewards differ."""

from __future__ import annotations

from fsdp_sync._demo.grpo_job import reward


def test_completions_of_the_same_length_do_not_tie() -> None:
    """Regression (CI, AsyncGRPO sparse test): two completions of one length scored alike, so the group's advantages
    were zero, the step moved nothing and the later syncs had nothing to send."""
    a, b = reward([[{"role": "assistant", "content": "abcd"}], [{"role": "assistant", "content": "wxyz"}]])
    assert a != b


def test_the_tie_break_keeps_the_preference_for_short_completions_with_the() -> None:
    short, longer = reward(["a cat", "a cats"])
    assert short > longer
    with_the, without = reward(["the cat", "a cat!!"])
    assert with_the > without
    assert reward(["same text"]) == reward(["same text"])  # deterministic
