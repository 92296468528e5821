"""Drafters as components: prompt lookup, composites, per-position acceptance, and their errors.

Whatever drafts, greedy output equals the target's own greedy decoding token for token and
sampled output keeps the target's distribution (chi-square at a fixed seed, as in test_sampling).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BACKEND, builtin_registry, reference_greedy, target, trained_drafter
from dynaspec.errors import ConfigError, UnknownComponentError
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.drafters import NGramIndex, merge_trees
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.stacks import resolve_stack
from dynaspec.runtime.tree import DraftTree


def make_engine(kind: str, model, registry, *, drafter, **fields) -> Engine:
    """An engine on a tiny target whose stack drafts with ``drafter`` (a trained drafter named in it
    is the ``model`` given)."""
    data = {"name": "test", "target": f"tiny-{kind}", "drafter": drafter, "backend": BACKEND, **fields}
    return Engine(stack_from_mapping(data), target(kind), model, registry=registry)


# -- the n-gram index --------------------------------------------------------------------------------
def test_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NGramIndex(sizes=(3, 2, 1), tokens=4)
    index.extend([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7])
    # "5 6 7" occurred at 0 (then 8 9 1 6); "6 7" more recently at 6 (then 2 3 5 6): longest first
    assert index.lookup() == ([8, 9, 1, 6], 3)
    index.extend([4])  # "7 4", "4": never seen before
    assert index.lookup() == ([], 0)
    index.extend([6, 7])  # "4 6 7" unseen; "6 7" latest usable at 11 (then 4 6: cut at the text's end)
    assert index.lookup() == ([4, 6, 7], 2)


def test_index_built_in_pieces_equals_index_built_at_once():
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 6, (300,), generator=gen).tolist()
    whole, pieces = NGramIndex((4, 3, 2), 5), NGramIndex((4, 3, 2), 5)
    whole.extend(text)
    at = 0
    while at < len(text):
        step = int(torch.randint(1, 7, (1,), generator=gen))
        pieces.extend(text[at:at + step])
        at += step
    assert pieces.table == whole.table and pieces.lookup() == whole.lookup()
    assert whole.lookup()[1] > 0  # a random text over 6 symbols repeats its 4-grams


def test_lookup_respects_min_ngram_and_proposal_length():
    index = NGramIndex(sizes=(3, 2), tokens=2)
    index.extend([1, 2, 3, 4, 5, 9, 3])
    assert index.lookup() == ([], 0)  # only "3" repeats, shorter than min_ngram = 2
    index.extend([4])
    assert index.lookup() == ([5, 9], 2)  # at most 2 tokens


def test_merged_trees_share_common_prefixes():
    a = DraftTree.with_root(1)
    x = a.add(0, 5, -0.1)
    a.add(x, 6, -0.2)
    b = DraftTree.with_root(1)
    y = b.add(0, 5, 0.0)
    z = b.add(y, 7, 0.0)
    b.add(z, 8, 0.0)
    m = merge_trees(a, b)
    assert m.tokens == [1, 5, 6, 7, 8] and m.parents == [-1, 0, 1, 1, 3]
    assert m.children[1] == [2, 3]  # the first tree's line stays first
    assert (a.tokens, len(b)) == ([1, 5, 6], 4)  # inputs untouched


# -- decoding -----------------------------------------------------------------------------------------
def _repeating_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        motif = torch.randint(3, 99, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        out.append(motif * 3 + motif[:2])
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("drafter", [
    {"name": "ngram", "min_ngram": 1, "max_ngram": 3},
    {"name": "composite", "drafters": [{"name": "ngram", "min_ngram": 2}, "in-memory"]},
], ids=["ngram", "composite-chain"])
def test_greedy_output_is_the_targets_with_prompt_lookup(kind, drafter):
    registry = builtin_registry()
    engine = make_engine(kind, trained_drafter(kind), registry, drafter=drafter,
                         draft={"mode": "chain", "depth": 5})
    assert engine.exactness == "guaranteed" and engine.source.chains_only
    drafted = accepted = 0
    sources = set()
    for prompt in _repeating_prompts():
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == reference_greedy(kind, prompt, 40), (prompt, drafter)
        assert sum(result.stats.accepted_lengths) == 39
        stats = result.stats
        drafted += sum(stats.drafted_at)
        accepted += sum(stats.accepted_at)
        sources |= set(stats.draft_sources)
        # every cycle drafted something or took a plain step
        assert stats.cycles == sum(1 for _ in stats.accepted_lengths)
        assert stats.plain_cycles + (stats.drafted_at[0] if stats.drafted_at else 0) == stats.cycles
    assert drafted > 0 and 0 < accepted <= drafted  # the repeats were found and some were right
    if drafter["name"] == "composite":
        assert sources == {0, 1}  # both the lookup and the trained drafter drafted cycles


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_composite_tree_merges_lookup_and_drafter(kind):
    registry = builtin_registry()
    engine = make_engine(kind, trained_drafter(kind), registry,
                         drafter={"name": "composite", "drafters": [{"name": "ngram", "min_ngram": 1}, "in-memory"]},
                         draft={"mode": "tree", "depth": 4, "topk": 2, "total_tokens": 8})
    assert engine.exactness == "not guaranteed" and not engine.source.chains_only
    for prompt in _repeating_prompts():
        result = engine.generate(prompt, max_new_tokens=30)
        assert result.token_ids == reference_greedy(kind, prompt, 30)
        assert result.stats.draft_sources[0] > 0 and result.stats.draft_sources[1] > 0


def test_a_drafter_with_a_context_reads_only_the_prompts_last_positions():
    """``context = N``: the trained drafter's first draft reads the text's last N positions (its
    cache starts there), then every new position; output stays plain decoding's."""
    registry = builtin_registry()
    prompt = [5, 9, 13, 2, 7, 30, 31, 9, 40, 41, 12, 3]
    plain = reference_greedy("llama", prompt, 24)
    lengths = {}
    for context in (None, 4):
        engine = make_engine("llama", trained_drafter("llama"), registry,
                             drafter={"name": "trained", "artifact": "in-memory", "context": context},
                             draft={"mode": "chain", "depth": 3})
        sessions = []
        start = engine.source.start
        engine.source.start = (lambda capacity, start=start, sessions=sessions:
                               sessions.append(start(capacity)) or sessions[-1])
        result = engine.generate(prompt, max_new_tokens=24)
        assert result.token_ids == plain
        session = sessions[0]
        assert session.offset == (0 if context is None else len(prompt) - context)
        lengths[context] = session.cache.length
    # the drafter read 8 fewer prompt positions, and then the same ones
    assert lengths[None] - lengths[4] == len(prompt) - 4
    with pytest.raises(ConfigError, match="context.*integer >= 1"):
        make_engine("llama", trained_drafter("llama"), registry,
                    drafter={"name": "trained", "artifact": "in-memory", "context": 0})


def test_keep_best_with_a_floor_keeps_the_first_line_and_likely_side_lines():
    """keep_best(total, floor): the best ``total`` nodes, of which the side lines only where the
    drafter gives them at least exp(floor); the first line stays whole; the result is closed under
    ancestors."""
    import math

    tree = DraftTree.with_root(1)
    a = tree.add(0, 10, math.log(0.5))    # first line: 0.5
    b = tree.add(0, 11, math.log(0.3))    # side: 0.3
    tree.add(0, 12, math.log(0.05))       # side: 0.05
    c = tree.add(a, 13, math.log(0.1))    # first line: 0.05
    tree.add(a, 14, math.log(0.4))        # side: 0.2
    tree.add(b, 15, math.log(0.2))        # side: 0.06
    tree.add(c, 16, math.log(0.9))        # first line: 0.045
    kept = tree.keep_best(10, floor=math.log(0.1))
    assert sorted(kept.tokens) == [1, 10, 11, 13, 14, 16]  # 12 and 15 fall below 0.1
    assert all(p < i for i, p in enumerate(kept.parents) if i)  # parents before children
    assert kept.first_line() == [0, 1, 3, 5] and [kept.tokens[i] for i in kept.first_line()] == [1, 10, 13, 16]
    assert sorted(tree.keep_best(3, floor=math.log(0.1)).tokens) == [1, 10, 11, 14]  # the best 3 first
    assert len(tree.keep_best(10)) == len(tree)  # no floor: everything within the total


def test_composite_tree_without_merging_drafts_the_first_proposal():
    """``merge = false`` in a tree stack: prompt lookup's chain where the text repeats, the trained
    drafter's tree elsewhere, never both in one cycle; its trees stay within the probed rows, so
    on the lean forward the stack is guaranteed, and its output is plain decoding's."""
    registry = builtin_registry()
    engine = make_engine("llama", trained_drafter("llama"), registry,
                         drafter={"name": "composite", "merge": False,
                                  "drafters": ["ngram", "in-memory"]},
                         draft={"mode": "tree", "depth": 4, "topk": 2, "total_tokens": 6}, exact="required")
    assert engine.exactness == "guaranteed", engine.exactness_reason
    assert engine.source.max_tokens == 6 and not engine.source.chains_only
    sources = [0, 0]
    for prompt in [*_repeating_prompts(), [7, 30, 2, 91, 14]]:
        result = engine.generate(prompt, max_new_tokens=30)
        assert result.token_ids == reference_greedy("llama", prompt, 30)
        stats = result.stats
        assert sum(stats.draft_sources.values()) == stats.cycles - stats.plain_cycles  # one source a cycle
        for index, count in stats.draft_sources.items():
            sources[index] += count
    assert sources[0] > 0 and sources[1] > 0
    with pytest.raises(ConfigError, match="merge.*must be true or false"):
        make_engine("llama", trained_drafter("llama"), registry,
                    drafter={"name": "composite", "merge": "no", "drafters": ["ngram", "in-memory"]})


def test_per_position_acceptance_in_statistics():
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), drafter="in-memory",
                         draft={"mode": "chain", "depth": 4})
    stats = engine.generate([5, 6, 7, 8, 5, 6, 7], max_new_tokens=30).stats
    assert len(stats.drafted_at) == 4 and stats.drafted_at[0] == stats.cycles  # a chain of 4 every cycle
    assert all(a <= d for a, d in zip(stats.accepted_at, stats.drafted_at))
    # accepted_at[p] counts the cycles whose accepted path reached position p + 1 (the last
    # cycle's committed tokens are cut at max_new_tokens, its accepted path is not)
    *lengths, last = [len_ - 1 for len_ in stats.accepted_lengths]
    before = [sum(1 for x in lengths if x > p) for p in range(4)]
    last_cycle = [a - b for a, b in zip(stats.accepted_at, before)]
    assert last_cycle == sorted(last_cycle, reverse=True) and set(last_cycle) <= {0, 1}
    assert sum(last_cycle) >= last
    data = stats.to_dict()
    assert data["acceptance_per_position"] == pytest.approx(
        [a / d for a, d in zip(stats.accepted_at, stats.drafted_at)])
    assert data["drafted_at"] == stats.drafted_at


# -- lossless sampling ------------------------------------------------------------------------------
def sampling_target():
    """The tiny target of the lossless-sampling checks (test_sampling's vocabulary)."""
    from test_sampling import VOCAB

    from dynaspec.plugins.tiny import tiny_target

    return tiny_target("llama", vocab_size=VOCAB, seed=2)


def sample_second_tokens(tgt, drafter, prompt: list[int], samples: int = 2500):
    """``samples`` seeded two-token generations of ``prompt`` by a sampling stack drafting with
    ``drafter`` (a chain of 3; ``"d"`` in it is an untrained model): the counts of the second token,
    the target's own distribution of it (``p2``), and each generation's statistics."""
    from test_sampling import VOCAB

    from dynaspec.plugins.verifiers import sampling_distribution
    from dynaspec.runtime.drafter import Drafter, DrafterConfig
    from dynaspec.runtime.protocols import DecodeParams

    torch.manual_seed(5)
    model = Drafter(DrafterConfig.like_target(tgt.model)).eval()
    params = DecodeParams(1.0, 1.0)

    @torch.no_grad()
    def dist(ids):
        return sampling_distribution(tgt.model(torch.tensor([ids])).logits[0, -1].float(),
                                     params).numpy().astype(np.float64)

    p1 = dist(prompt)
    p2 = sum(p1[y] * dist(prompt + [y]) for y in range(VOCAB) if p1[y] > 0)
    engine = Engine(stack_from_mapping({"name": "s", "target": "tiny", "drafter": drafter, "verifier": "sampling",
                                        "draft": {"mode": "chain", "depth": 3}}), tgt, model,
                    registry=builtin_registry())
    counts, stats = np.zeros(VOCAB), []
    for seed in range(samples):
        result = engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed)
        counts[result.token_ids[1]] += 1
        stats.append(result.stats)
    return counts, p2, stats


@pytest.mark.parametrize("drafter", [
    {"name": "ngram", "min_ngram": 1, "max_ngram": 2},
    {"name": "composite", "drafters": [{"name": "ngram", "min_ngram": 1}, "d"]},
], ids=["ngram", "composite"])
def test_sampling_with_prompt_lookup_keeps_target_distribution(drafter):
    from test_sampling import chi2_pvalue

    prompt = [0, 3, 5, 7, 0, 3, 5, 7, 0, 3]  # every token repeats: lookups propose at once
    samples = 2500
    counts, p2, stats = sample_second_tokens(sampling_target(), drafter, prompt, samples)
    drafted = sum(sum(s.drafted_at) for s in stats)
    accepted = sum(sum(s.accepted_at) for s in stats)
    assert chi2_pvalue(counts, p2) > 1e-3
    assert 0.5 * np.abs(counts / samples - p2).sum() < 0.06
    assert 0 < accepted < drafted  # lookups were drafted, and both accepted and rejected


# -- configuration and errors -----------------------------------------------------------------------
def test_drafter_names_tables_and_shorthand(registry):
    stack = stack_from_mapping({"name": "s", "target": "tiny-llama", "drafter": "ngram"})
    assert stack.drafter.name == "ngram" and stack.drafter_label == "ngram"
    assert stack.to_dict()["drafter"] == "ngram"
    table = stack_from_mapping({"name": "s", "target": "tiny-llama",
                                "drafter": {"name": "ngram", "max_ngram": 3}})
    assert table.to_dict()["drafter"] == {"name": "ngram", "max_ngram": 3}
    assert "max_ngram=3" in table.drafter_label
    assert stack.with_overrides({"drafter": "none"}).drafter is None
    assert stack.with_overrides({"drafter.max_ngram": 5}).drafter.kwargs == {"max_ngram": 5}
    registry.check_stack(table)
    # a name no drafter has is a trained drafter's artifact
    from dynaspec.runtime.drafters import drafter_component

    assert drafter_component(stack_from_mapping({"name": "s", "target": "x", "drafter": "gemma3-270m"}).drafter,
                             registry).to_dict() == {"name": "trained", "artifact": "gemma3-270m"}


@pytest.mark.parametrize("drafter,message", [
    ({"name": "ngram", "min_ngram": 4, "max_ngram": 2}, "min_ngram = 4 exceeds max_ngram = 2"),
    ({"name": "ngram", "tokens": 0}, "drafter.tokens = 0 is invalid"),
    ({"name": "ngram", "size": 3}, "has no parameter 'size'"),
    ({"name": "composite", "drafters": ["ngram"]}, "at least two"),
    ({"name": "composite", "drafters": ["ngram", "composite"]}, "cannot contain another composite"),
    ({"name": "nosuch", "x": 1}, "unknown drafter 'nosuch'"),
])
def test_bad_drafters_are_refused_with_a_clear_message(drafter, message):
    with pytest.raises((ConfigError, UnknownComponentError), match=message):
        make_engine("llama", None, builtin_registry(), drafter=drafter, draft={"mode": "chain", "depth": 3})


def test_eagle_drafter_refuses_a_dynaspec_artifact(tmp_path):
    trained_drafter("llama").save(tmp_path / "d")
    with pytest.raises(ConfigError, match="not an EAGLE checkpoint"):
        Engine(stack_from_mapping({"name": "s", "target": "tiny-llama", "draft": {"mode": "chain"},
                                   "drafter": {"name": "eagle", "artifact": str(tmp_path / "d")}}),
               target("llama"), None, registry=builtin_registry())


def test_builtin_stack_with_prompt_lookup_resolves(registry):
    stack = resolve_stack("default", registry=registry)
    assert stack.drafter.name == "composite" and stack.exact == "required"
    registry.check_stack(stack)


def test_default_drafts_a_tree_where_rows_are_cheap_else_its_chain(registry):
    # default: draft.mode = "auto", a tree of up to 8 drafted tokens (8 + the root within the 16
    # rows every quantised probe covers) or the chain of 5; prompt lookup's chain or the drafter's
    # tree, never merged
    from dynaspec.runtime import quantized

    stack = resolve_stack("default", registry=registry)
    assert stack.draft.mode == "auto" and stack.draft.total_tokens + 1 <= quantized.PROBE_ROWS
    assert (stack.draft.depth, stack.draft.topk, stack.draft.min_confidence) == (5, 3, 0.1)
    assert stack.draft.as_chain().total_tokens == 5 and stack.exact == "required"
    assert dict(stack.drafter.params)["merge"] is False


# -- the gate: plain steps while drafting does not pay ----------------------------------------------
def test_gate_falls_back_to_plain_steps_and_looks_again():
    from dynaspec.runtime.gate import FIRST_BACKOFF, MAX_BACKOFF, WARMUP, DraftGate, PlainCost

    plain = PlainCost()
    gate = DraftGate(plain)
    # drafted cycles committing 1 token in 30 ms, while a verification takes 20 ms: plain pays
    for _ in range(WARMUP):
        assert gate.draft_now()
        gate.record(drafted=True, tokens=1, seconds=0.030, verify_seconds=0.020)
    assert not gate.draft_now() and gate.wait == FIRST_BACKOFF
    for _ in range(FIRST_BACKOFF):
        assert not gate.draft_now()
        gate.record(drafted=False, tokens=1, seconds=0.018, verify_seconds=0.018)
    assert plain.estimate == pytest.approx(0.018)
    assert gate.draft_now()  # a look: it fails, and the next wait is twice as long
    gate.record(drafted=True, tokens=1, seconds=0.030, verify_seconds=0.020)
    assert gate.wait == 2 * FIRST_BACKOFF
    for _ in range(2 * FIRST_BACKOFF):
        gate.record(drafted=False, tokens=1, seconds=0.018, verify_seconds=0.018)
    # a look that pays (4 tokens in 35 ms): drafting goes on, the backoff is reset
    gate.record(drafted=True, tokens=4, seconds=0.035, verify_seconds=0.025)
    assert gate.draft_now() and gate.backoff == FIRST_BACKOFF
    for _ in range(10):
        gate.record(drafted=True, tokens=3, seconds=0.035, verify_seconds=0.025)
        assert gate.draft_now()
    # the backoff never exceeds its cap
    for _ in range(20):
        gate.record(drafted=True, tokens=1, seconds=0.1, verify_seconds=0.025)
        while not gate.draft_now():
            gate.record(drafted=False, tokens=1, seconds=0.018, verify_seconds=0.018)
    assert gate.backoff == MAX_BACKOFF


def test_verification_cost_by_rows_is_measured_interpolated_and_extended():
    from dynaspec.runtime.gate import PlainCost

    costs = PlainCost()
    assert costs.verification(3) is None
    costs.record_plain(0.020)
    assert costs.verification(1) == pytest.approx(0.020) and costs.verification(4) == pytest.approx(0.020)
    costs.record_verification(0.026, rows=4)
    assert costs.verification(4) == pytest.approx(0.026)
    assert costs.verification(2) == pytest.approx(0.022)  # between 1 and 4 rows
    assert costs.verification(7) == pytest.approx(0.032)  # along the line from 1 row to 4
    costs.record_verification(0.030, rows=4)
    assert costs.verification(4) == pytest.approx(0.028)  # an average of the measurements


def _planner(plain=0.020, step=0.004, per_row=0.001, whole_depth=False):
    from dynaspec.runtime.gate import CostPlanner, PlainCost

    costs = PlainCost()
    costs.record_plain(plain)
    for rows in range(2, 8):
        costs.record_verification(plain + per_row * (rows - 1), rows=rows)
    costs.record_draft(step, 1)
    return CostPlanner(costs, whole_depth=whole_depth)


def _record_good_generation(planner, cycles=6):
    """Cycles whose positions 1-2 are always accepted and 3 never."""
    for _ in range(cycles):
        planner.record(drafted=True, seconds=0.040, verify_seconds=0.024, rows=6, draft_seconds=0.016,
                       reached=5, accepted=2)


def _failures_before_plain(planner, most=20) -> int:
    """Failed drafted cycles the planner takes before it holds the drafter to plain steps."""
    failed = 0
    while planner.cap(5) != 0:
        planner.record(drafted=True, seconds=0.030, verify_seconds=0.022, rows=3, draft_seconds=0.008,
                       reached=2, accepted=0)
        failed += 1
        assert failed < most
    return failed


def test_cost_planner_drafts_deep_when_drafts_are_accepted_and_stops_where_they_are_not():
    from dynaspec.runtime.gate import FIRST_BACKOFF

    planner = _planner()
    assert planner.cap(5) is None  # nothing verified yet: draft as the stack says
    _record_good_generation(planner)
    assert planner.acceptance(3)[0] > 0.9 and planner.acceptance(3)[2] < 0.3
    assert planner.cap(5) == 2
    # a generation whose drafts all fail: plain steps, then a look, then a longer wait
    failing = _planner()
    failing.costs = planner.costs
    failed = _failures_before_plain(failing, most=8)
    # the earlier generation's acceptance (a prior of 2 cycles) is outweighed after a few failures
    assert 2 <= failed <= 5 and failing.wait == FIRST_BACKOFF
    for _ in range(FIRST_BACKOFF):
        failing.record(drafted=False, seconds=0.021, verify_seconds=0.020)
    assert failing.cap(5) is None  # the look drafts as the stack says
    failing.record(drafted=True, seconds=0.030, verify_seconds=0.022, rows=3, draft_seconds=0.008,
                   reached=2, accepted=0)
    assert failing.backoff == 2 * FIRST_BACKOFF
    assert failing.cap(5) == 0 and failing.wait == 2 * FIRST_BACKOFF


def test_cost_gate_planner_drafts_the_whole_depth_where_drafting_pays_and_plain_steps_where_it_does_not():
    """``planner = "cost-gate"``: the cost model's decision whether to draft, never its depth."""
    from dynaspec.runtime.gate import FIRST_BACKOFF

    planner = _planner(whole_depth=True)
    _record_good_generation(planner)
    assert planner.best_depth(5) == 2  # the cost planner would cap the draft at 2 positions
    assert planner.cap(5) is None  # the gate drafts as deep as the stack says
    failing = _planner(whole_depth=True)
    failing.costs = planner.costs
    failed = _failures_before_plain(failing, most=8)
    assert 2 <= failed <= 5 and failing.wait == FIRST_BACKOFF


def test_cost_planner_drafts_nothing_where_a_draft_step_costs_more_than_it_can_gain():
    planner = _planner(plain=0.020, step=0.030)  # a draft step dearer than a plain step
    planner.record(drafted=True, seconds=0.060, verify_seconds=0.022, rows=3, draft_seconds=0.060,
                   reached=2, accepted=1)
    assert planner.cap(5) == 0


def test_auto_planner_drafts_whole_trees_only_where_a_trees_rows_cost_about_one(monkeypatch):
    from conftest import random_drafter
    from dynaspec.runtime import numerics

    registry = builtin_registry()
    fields = {"draft": {"mode": "chain", "depth": 4, "adaptive": True, "planner": "auto"}}
    build = lambda: make_engine("llama", random_drafter("llama"), registry, drafter="in-memory", **fields)  # noqa: E731
    assert not numerics.cheap_rows(build().target) and not build().whole_depth  # the cost planner's depth
    monkeypatch.setattr(numerics, "cheap_rows", lambda target: True)
    assert build().whole_depth
    fields["draft"]["planner"] = "cost"
    assert not build().whole_depth


@pytest.mark.parametrize("planner", ["rate", "cost", "cost-gate", "auto"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_adaptive_engine_decodes_plainly_when_drafts_fail_and_stays_exact(kind, planner):
    from conftest import random_drafter

    registry = builtin_registry()
    fields = {"draft": {"mode": "chain", "depth": 4, "adaptive": True, "planner": planner}}
    engine = make_engine(kind, random_drafter(kind), registry, drafter="in-memory", **fields)
    prompt = [5, 9, 13, 21]
    result = engine.generate(prompt, max_new_tokens=60)
    assert result.token_ids == reference_greedy(kind, prompt, 60)
    stats = result.stats
    # an untrained drafter is almost never right: most cycles become plain steps
    assert stats.plain_cycles > stats.cycles // 2 and stats.drafted_at[0] + stats.plain_cycles == stats.cycles
    # a drafter that is right keeps drafting
    trained = make_engine(kind, trained_drafter(kind), registry, drafter="in-memory", **fields)
    prompt = _repeating_prompts()[0]
    result = trained.generate(prompt, max_new_tokens=40)
    assert result.token_ids == reference_greedy(kind, prompt, 40)


def test_a_drafter_given_on_another_device_than_its_target_is_refused():
    import copy

    from conftest import make_engine

    elsewhere = copy.deepcopy(trained_drafter("llama")).to("meta")
    with pytest.raises(ConfigError, match=r"is on meta, its target on cpu: move it first"):
        make_engine("llama", elsewhere, builtin_registry())


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cost_planner_holds_a_failing_drafter_but_not_prompt_lookup(kind):
    """A random drafter's chains fail: the cost planner holds it to plain steps, while prompt
    lookup (which costs next to nothing to draft) still proposes on the repeating text."""
    from conftest import random_drafter

    registry = builtin_registry()
    composite = {"name": "composite", "drafters": [{"name": "ngram", "min_ngram": 2}, "in-memory"]}
    runs = {}
    for planner in ("none", "cost"):
        draft = {"mode": "chain", "depth": 4}
        if planner == "cost":
            draft.update(adaptive=True, planner="cost")
        engine = make_engine(kind, random_drafter(kind), registry, drafter=composite, draft=draft)
        sources = [0, 0]
        for prompt in _repeating_prompts():
            result = engine.generate(prompt, max_new_tokens=48)
            assert result.token_ids == reference_greedy(kind, prompt, 48)
            for index, count in result.stats.draft_sources.items():
                sources[index] += count
        runs[planner] = sources
    assert runs["cost"][0] > 0  # prompt lookup kept drafting
    assert runs["cost"][1] < runs["none"][1]  # the failing drafter drafted fewer cycles


def test_a_lighter_prior_stops_a_failing_generation_sooner():
    from dynaspec.runtime.gate import CostPlanner

    def failures_before_plain(weight):
        history = _planner()
        _record_good_generation(history)  # earlier generations
        return _failures_before_plain(CostPlanner(history.costs, prior_weight=weight))

    light, heavy = failures_before_plain(1.0), failures_before_plain(4.0)
    assert 1 <= light < heavy


def test_a_position_that_failed_early_is_not_written_off_and_a_capped_generation_looks_deeper():
    """Two failed drafts at position 2 in the engine's first generation once set its pooled
    acceptance to 0 for good: every later generation was capped at one position and never drafted
    position 2 again to learn otherwise. The pooled count now starts from POOL_PRIOR drafts at the
    unseen rate, and a capped generation drafts one position deeper every EXPLORE_EVERY-th cycle."""
    from dynaspec.runtime.gate import EXPLORE_EVERY, POOL_PRIOR, UNSEEN_ACCEPTANCE, CostPlanner

    first = _planner(plain=0.020, step=0.002, per_row=0.0005)
    for _ in range(2):  # position 1 accepted, position 2 not
        first.record(drafted=True, seconds=0.030, verify_seconds=0.022, rows=3, draft_seconds=0.004,
                     reached=2, accepted=1)
    later = CostPlanner(first.costs)
    # the generation has no counts of its own yet: its estimates are the pooled ones
    pooled_1 = (2 + POOL_PRIOR * UNSEEN_ACCEPTANCE) / (2 + POOL_PRIOR)
    pooled_2 = (0 + POOL_PRIOR * UNSEEN_ACCEPTANCE * pooled_1) / (2 + POOL_PRIOR)
    assert later.acceptance(2) == pytest.approx([pooled_1, pooled_2])
    assert pooled_2 > 0.2
    # a generation whose drafts are accepted at position 1 only, and whose costs make position 2
    # not worth a step: capped at 1, and every EXPLORE_EVERY-th capped cycle drafts 2
    capped = _planner(plain=0.020, step=0.008, per_row=0.0005)
    caps = []
    for _ in range(3 * EXPLORE_EVERY):
        caps.append(capped.cap(5))
        depth = caps[-1] or 5
        capped.record(drafted=True, seconds=0.030, verify_seconds=0.021, rows=depth + 1,
                      draft_seconds=0.008 * depth, reached=depth, accepted=1)
    assert caps[0] is None  # nothing measured yet: as the stack says
    assert caps.count(2) == 2 and set(caps[1:]) == {1, 2}
    assert [i for i, c in enumerate(caps[1:], start=1) if c == 2] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY]
