"""The embedded default end to end (slow: loads the real Gemma 3 270M target)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines():
    from dynaspec.runtime.engine import Engine

    base = Engine.from_stack("baseline")
    return base, Engine.from_stack("gemma", target=base.target)


@pytest.mark.parametrize("prompt", ["Write a Python function that reverses a string.",
                                    "Wie spät ist es in Berlin, wenn es in Tokio Mittag ist?"])
def test_default_stack_matches_baseline(engines, prompt):
    from dynaspec.runtime.prompt import format_prompt

    base, spec = engines
    text = format_prompt(prompt)
    ref = base.generate(text, max_new_tokens=32)
    out = spec.generate(text, max_new_tokens=32)
    assert out.token_ids == ref.token_ids
    assert out.stats.mean_accepted_length > 1.0


def test_shipped_artifacts_refuse_another_target():
    from dynaspec.errors import ArtifactMismatchError
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.targets import load_drafter

    with pytest.raises(ArtifactMismatchError):
        load_drafter("gemma3-270m", tiny_target("llama"))


SHORTLISTING_STACKS = ["fr-spec", "fr-spec-pa", "dynaspec-fixed", "dynaspec", "dynaspec-hybrid",
                       "dynaspec-confidence", "dynaspec-hybrid-confidence", "dynaspec-context",
                       "dynaspec-hybrid-context"]


@pytest.mark.parametrize("stack", SHORTLISTING_STACKS)
def test_shortlisting_stacks_match_baseline(engines, stack):
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.prompt import format_prompt

    base, _ = engines
    spec = Engine.from_stack(stack, target=base.target)
    text = format_prompt("Translate to French: the cat sleeps on the warm windowsill.")
    ref = base.generate(text, max_new_tokens=24)
    out = spec.generate(text, max_new_tokens=24)
    assert out.token_ids == ref.token_ids
    assert 0 < out.stats.mean_shortlist_size < 0.2 * base.target.vocab_size
