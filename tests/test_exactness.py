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
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.config import stack_from_mapping
    from dynaspec.runtime.engine import Engine

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
    assert stats.cycles > 0
    # every token after the prefill's was committed by exactly one cycle, 1 to depth + 1 at a time
    assert sum(stats.accepted_lengths) == stats.new_tokens - 1 == 29
    assert set(stats.accepted_length_histogram) <= set(range(1, 6))
    assert stats.mean_shortlist_size == target("llama").vocab_size  # full vocabulary
    assert set(stats.shortlist_size_per_depth) <= set(range(4))
    assert stats.times["target_body"] > 0 and stats.times["draft_core"] > 0 and stats.times["head_gemm"] > 0
    assert stats.tokens_per_second > 0


def test_selected_backend_really_ran(registry):
    """nox runs the suite once per backend: make sure that backend did the head products."""
    engine = make_engine("llama", trained_drafter("llama"), registry, draft={"mode": "chain", "depth": 3})
    before = engine.backend.calls
    engine.generate([9, 10, 11], max_new_tokens=12)
    assert engine.backend.name == BACKEND and engine.backend.calls > before


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_confidence_stop_drafts_less_and_stays_exact(kind, mode):
    """draft.min_confidence ends a draft early once the drafter's likeliest line is unlikely: fewer
    draft steps, and the output is still the target's."""
    draft = {"mode": mode, "depth": 6} if mode == "chain" else {"mode": "tree", "depth": 5, "topk": 3,
                                                                "total_tokens": 12}
    steps = {}
    for threshold in (0.0, 0.6):
        engine = make_engine(kind, trained_drafter(kind), builtin_registry(),
                             draft={**draft, "min_confidence": threshold})
        total = 0
        for prompt in _prompts(seed=11, count=3):
            result = engine.generate(prompt, max_new_tokens=30)
            assert result.token_ids == reference_greedy(kind, prompt, 30), (prompt, threshold)
            total += result.stats.draft_steps
            assert result.stats.draft_steps <= 6 * result.stats.cycles
        steps[threshold] = total
    assert steps[0.6] < steps[0.0]


def test_chain_verification_reads_the_head_once_per_cycle(registry):
    """A chain's full-vocabulary rows come from one batched head product per cycle."""
    engine = make_engine("llama", trained_drafter("llama"), registry, draft={"mode": "chain", "depth": 4})
    result = engine.generate([9, 10, 11], max_new_tokens=30)
    assert result.stats.verify_products == result.stats.cycles > 0
    assert len(result.stats.verify_times) == result.stats.cycles


def test_tree_verification_computes_lines_as_it_leaves_them(registry):
    """A tree's first product covers the drafter's favourite line; another comes only where
    verification leaves it, so products stay far below the node count."""
    engine = make_engine("llama", random_drafter("llama"), registry,
                         draft={"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 12})
    result = engine.generate([9, 10, 11], max_new_tokens=30)
    stats = result.stats
    assert stats.cycles <= stats.verify_products <= sum(stats.accepted_lengths)


def test_preallocated_caches_compact_in_place_and_grow():
    """The target's KV cache keeps an arbitrary subset of the appended entries in order, and grows
    past an under-sized capacity without losing entries."""
    tgt = target("llama")
    cache = tgt.new_cache(capacity=4)  # smaller than what follows: it must grow
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    tgt.forward(ids, torch.arange(6), cache)
    layer = cache.layers[0]
    before_k = layer.keys.clone()
    tgt.forward(torch.tensor([11, 12, 13, 14]), torch.arange(6, 10), cache)
    appended = layer.keys[:, :, 6:10].clone()
    tgt.keep(cache, 6, [1, 3])
    assert cache.get_seq_length() == 8 == layer.keys.shape[-2]
    assert torch.equal(layer.keys[:, :, :6], before_k)
    assert torch.equal(layer.keys[:, :, 6:8], appended[:, :, [1, 3]])
    tgt.keep(cache, 6, [0])  # a prefix: nothing moves, the length shrinks
    assert cache.get_seq_length() == 7 and torch.equal(layer.keys[:, :, 6], appended[:, :, 1])


def test_draft_cache_grows_and_crops():
    from dynaspec.runtime.drafter import DraftCache

    cache = DraftCache(capacity=2)
    k = torch.arange(24.0).view(1, 2, 3, 4)
    keys, _ = cache.append(k, k)
    assert cache.length == 3 and torch.equal(keys, k)
    keys, _ = cache.append(k[:, :, :1] + 100, k[:, :, :1])
    assert cache.length == 4 and torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3], k[:, :, 0] + 100)
    cache.crop(2)
    keys, _ = cache.append(k[:, :, 2:], k[:, :, 2:])
    assert cache.length == 3 and torch.equal(keys, k)


def test_long_prompt_prefill_in_chunks_with_progress(monkeypatch, capsys):
    """A long prompt is prefilled in chunks with a progress bar; plain and speculative decoding
    chunk alike, so the output is still the baseline's."""
    from dynaspec.runtime import engine as engine_mod

    monkeypatch.setattr(engine_mod, "LONG_PROMPT", 16)
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 8)
    prompt = _prompts(seed=5, count=1)[0] * 4 + list(range(3, 40))
    spec = make_engine("llama", trained_drafter("llama"), builtin_registry(), draft={"mode": "chain", "depth": 4})
    plain = make_engine("llama", None, builtin_registry())
    out = spec.generate(prompt, max_new_tokens=20).token_ids
    assert "prefill" in capsys.readouterr().err
    assert out == plain.generate(prompt, max_new_tokens=20).token_ids
    assert out == reference_greedy("llama", prompt, 20)
