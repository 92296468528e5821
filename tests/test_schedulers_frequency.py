"""Position-aware and fixed schedulers; the frequency shortlister and its artifact."""

from __future__ import annotations

import pytest
import torch

from conftest import builtin_registry, make_engine, reference_greedy, target, trained_drafter
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.types import DraftStep
from dynaspec.shortlisters.frequency import FrequencyShortlister, load_frequency, save_frequency


def test_position_aware_budget_follows_the_paper(registry):
    sched = registry.build("scheduler", "position-aware", {"k_max": 64}, None)
    assert [sched.budget(depth=t) for t in range(7)] == [64, 64, 10, 8, 6, 5, 4]
    tiny = registry.build("scheduler", "position-aware", {"k_max": 3}, None)
    assert tiny.budget(depth=6) == 1  # never below 1
    with pytest.raises(ConfigError, match="k_max = 0 is invalid"):
        registry.build("scheduler", "position-aware", {"k_max": 0}, None)
    with pytest.raises(ConfigError, match="no parameter"):
        registry.build("scheduler", "position-aware", {"kmax": 5}, None)


def _step(depth):
    return DraftStep(depth=depth, tokens=torch.tensor([1]), token_embeddings=torch.zeros(1, 4),
                     prev_hidden=torch.zeros(1, 4))


def test_frequency_artifact_roundtrip_and_fingerprint(tmp_path):
    tgt = target("llama")
    counts = torch.zeros(tgt.vocab_size, dtype=torch.long)
    counts[[50, 7, 9]] = torch.tensor([10, 30, 20])
    path = save_frequency(tmp_path, counts, {"target": tgt.fingerprint(), "corpus": "unit test"})
    ranked, prov = load_frequency(path, tgt.fingerprint())
    assert ranked[:3].tolist() == [7, 9, 50] and prov["corpus"] == "unit test"
    with pytest.raises(ArtifactMismatchError):
        load_frequency(path, target("gemma3").fingerprint())
    short = FrequencyShortlister(ranked, special=(1,), vocab_size=tgt.vocab_size)
    sl = short.shortlist(3)
    assert sl.token_ids.tolist() == [1, 7, 9] and sl.spans == ((0, 3),)
    assert short.head_layout[:3].tolist() == [1, 7, 9]
    assert sorted(short.head_layout.tolist()) == list(range(tgt.vocab_size))  # a permutation


def test_frequency_with_context_adds_the_context_tokens_below_the_budget(registry):
    from dynaspec.runtime.types import DraftStep

    ranked = torch.tensor([7, 9, 50, 3])
    short = FrequencyShortlister(ranked, special=(1,), vocab_size=64, context=4)
    fixed = registry.build("scheduler", "fixed", {"budget": 3}, None)
    step = DraftStep(depth=0, tokens=torch.tensor([5]), token_embeddings=torch.zeros(1, 4),
                     prev_hidden=torch.zeros(1, 4), context=torch.tensor([60, 61, 9, 40, 40, 3, 7]))
    sl = short.propose(step, fixed)
    # the top 3 are [1, 7, 9]; of the last 4 context tokens 40 and 3 rank below them (each once)
    assert sl.token_ids[:3].tolist() == [1, 7, 9] and sl.spans == ((0, 3),)
    assert sorted(sl.token_ids[3:].tolist()) == [3, 40]
    inside = DraftStep(depth=0, tokens=step.tokens, token_embeddings=step.token_embeddings,
                       prev_hidden=step.prev_hidden, context=torch.tensor([7, 9, 1]))
    assert short.propose(inside, fixed) is short.shortlist(3)  # nothing to add: the cached list


@pytest.mark.parametrize("scheduler", [{"name": "fixed", "budget": 24}, {"name": "position-aware", "k_max": 48}])
def test_frequency_stacks_are_exact(tmp_path, scheduler):
    tgt = target("llama")
    counts = torch.bincount(torch.tensor(reference_greedy("llama", [5, 6, 7], 60)), minlength=tgt.vocab_size)
    path = save_frequency(tmp_path, counts, {"target": tgt.fingerprint()})
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(),
                         shortlister={"name": "frequency", "path": str(path)}, scheduler=scheduler,
                         draft={"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10})
    with_context = make_engine("llama", trained_drafter("llama"), builtin_registry(),
                               shortlister={"name": "frequency", "path": str(path), "context": 64},
                               scheduler=scheduler, draft={"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10})
    for prompt in ([5, 6, 7], [40, 41, 3, 9]):
        result = engine.generate(prompt, max_new_tokens=30)
        assert result.token_ids == reference_greedy("llama", prompt, 30)
        assert with_context.generate(prompt, max_new_tokens=30).token_ids == result.token_ids
    per_depth = result.stats.shortlist_size_per_depth
    if scheduler["name"] == "fixed":
        assert set(per_depth.values()) == {24}
    else:
        assert per_depth[0] == per_depth[1] == 48 and per_depth[2] == 8 and per_depth[3] == 6
