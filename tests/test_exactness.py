"""Greedy speculative output equals the target's own greedy decoding, token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BACKEND,
    builtin_registry,
    make_engine,
    random_drafter,
    reference_greedy,
    target,
    trained_drafter,
)
from plugins_for_tests import TestPlugin

DRAFTS = [
    {"mode": "chain", "depth": 1},
    {"mode": "chain", "depth": 3},
    {"mode": "chain", "depth": 6},
    {"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 12},
    {"mode": "tree", "depth": 6, "topk": 10, "total_tokens": 60},
]
COMPONENTS = [
    {},
    {"shortlister": {"name": "random-subset", "seed": 3}, "scheduler": {"name": "fixed", "budget": 40}},
    {"shortlister": {"name": "random-subset", "seed": 4, "per_row": True},
     "scheduler": {"name": "halving", "start": 64}},
]


def _prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 99, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("draft", DRAFTS, ids=lambda d: f"{d['mode']}{d['depth']}-k{d.get('topk', 1)}")
@pytest.mark.parametrize("components", COMPONENTS, ids=["full", "random-subset", "per-row-halving"])
def test_greedy_matches_target(kind, draft, components):
    registry = builtin_registry(TestPlugin())
    engine = make_engine(kind, trained_drafter(kind), registry, draft=draft, **components)
    accepted = []
    for prompt in _prompts(seed=len(str(draft)) + len(components), count=3):
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == reference_greedy(kind, prompt, 40), (prompt, draft, components)
        assert result.stats.new_tokens == 40
        assert sum(result.stats.accepted_lengths) == 39  # every token after the prefill's
        accepted += result.stats.accepted_lengths
    if components == {} and draft["depth"] > 1:
        # the trained drafter is right often enough for drafts to be accepted
        assert max(accepted) > 1


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_rollback_with_mostly_rejected_drafts(kind):
    """A random drafter is almost always wrong: long generations exercise cache rollback (the
    Gemma3 target has an 8-token sliding window, so windows are crossed many times)."""
    engine = make_engine(kind, random_drafter(kind), builtin_registry(),
                         draft={"mode": "tree", "depth": 5, "topk": 4, "total_tokens": 20})
    prompt = [5, 9, 31, 7]
    result = engine.generate(prompt, max_new_tokens=150)
    assert result.token_ids == reference_greedy(kind, prompt, 150)
    assert result.stats.mean_accepted_length < 1.5  # mostly rejected, as intended


def test_stops_at_eos():
    from dynaspec.config import stack_from_mapping
    from dynaspec.engine import Engine
    from dynaspec.targets import tiny_target

    prompt = [4, 8, 15, 16]
    free = reference_greedy("llama", prompt, 30)
    eos = free[12]  # a token the target will emit: treat it as EOS
    tgt_eos = tiny_target("llama", eos_token_id=eos)
    engine = Engine(stack_from_mapping({"name": "t", "target": "x", "drafter": "d",
                                        "draft": {"mode": "chain", "depth": 4}}),
                    tgt_eos, trained_drafter("llama"), registry=builtin_registry())
    result = engine.generate(prompt, max_new_tokens=30)
    expected = tgt_eos.model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert result.token_ids == expected[0, len(prompt):].tolist()
    assert result.token_ids[-1] == eos and len(result.token_ids) == free.index(eos) + 1


def test_plain_baseline_matches_target(registry):
    engine = make_engine("gemma3", None, registry)
    prompt = [3, 14, 15, 92, 65]
    assert engine.generate(prompt, max_new_tokens=25).token_ids == reference_greedy("gemma3", prompt, 25)


def test_statistics_are_consistent(registry):
    engine = make_engine("llama", trained_drafter("llama"), registry,
                         draft={"mode": "tree", "depth": 4, "topk": 4, "total_tokens": 16},
                         shortlister="full")
    result = engine.generate([7, 7, 21], max_new_tokens=30)
    stats = result.stats
    assert stats.cycles == len(stats.accepted_lengths) > 0
    assert stats.mean_accepted_length == pytest.approx(sum(stats.accepted_lengths) / stats.cycles)
    assert sum(stats.accepted_length_histogram.values()) == stats.cycles
    assert stats.mean_shortlist_size == target("llama").vocab_size  # full vocabulary
    assert set(stats.shortlist_size_per_depth) <= set(range(4))
    assert stats.times["verify"] > 0 and stats.times["draft_core"] > 0 and stats.times["head_gemm"] > 0
    assert stats.tokens_per_second > 0


def test_selected_backend_really_ran(registry):
    """nox runs the suite once per backend: make sure that backend did the head products."""
    engine = make_engine("llama", trained_drafter("llama"), registry, draft={"mode": "chain", "depth": 3})
    before = engine.backend.calls
    engine.generate([9, 10, 11], max_new_tokens=12)
    assert engine.backend.name == BACKEND and engine.backend.calls > before
