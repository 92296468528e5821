"""The batch's draft depths (``dynaspec.serving.planner``): the grant is the best one, the cost fit
recovers the costs it is fed, limits reach the drafters, and no limit changes greedy output."""

from __future__ import annotations

import asyncio
import itertools
import random

import numpy as np
import pytest
import torch

from conftest import builtin_registry, interleaved, make_engine, trained_drafter
from dynaspec.runtime.drafters import grow_within
from dynaspec.runtime.gate import DepthControl
from dynaspec.runtime.tree import DraftTree
from dynaspec.serving import planner as planner_mod
from dynaspec.serving.planner import CycleCosts, DepthPlanner, grant


def _rate(rates, limits, base, per_row):
    granted = sum(rates[i, :n].sum() for i, n in enumerate(limits))
    return (len(limits) + granted) / (base + per_row * sum(limits))


def test_the_grant_is_the_best_set_of_limits():
    rng = np.random.default_rng(0)
    for _ in range(200):
        requests, depth = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        rates = np.minimum.accumulate(rng.uniform(0, 1, (requests, depth)), axis=1)
        base, per_row = float(rng.uniform(0.01, 1)), float(rng.uniform(0, 0.5))
        limits = [depth if n is None else n for n in grant(rates, base, per_row)]
        best = max(_rate(rates, c, base, per_row) for c in itertools.product(range(depth + 1), repeat=requests))
        assert _rate(rates, limits, base, per_row) == pytest.approx(best, rel=1e-12)


def test_free_rows_draft_in_full_and_dear_rows_not_at_all():
    rates = np.array([[0.8, 0.6, 0.3], [0.5, 0.2, 0.1]])
    assert grant(rates, 1.0, 0.0) == [None, None]  # every position granted: as the stack says
    assert grant(rates, 1.0, 10.0) == [0, 0]
    # a row costing 0.11 of the base pays while its rate beats the batch's tokens per second times
    # that cost: 0.8, 0.6 and 0.5 do (2.93 tokens per base with them), 0.3 does not
    assert grant(rates, 1.0, 0.11) == [2, 1]


def test_the_cost_fit_recovers_the_costs_it_is_fed():
    costs = CycleCosts()
    rng = random.Random(1)
    for _ in range(planner_mod.MIN_CYCLES - 1):
        costs.observe(4, rng.randint(0, 12), 1.0)
    assert costs.fit() is None  # too few cycles
    for _ in range(planner_mod.WINDOW):  # the cycles above leave the window
        b, e = rng.randint(1, 8), rng.randint(0, 20)
        costs.observe(b, e, 0.02 + 0.01 * b + 0.004 * e)
    assert costs.fit() == pytest.approx((0.02, 0.01, 0.004), abs=1e-9)
    flat = CycleCosts()
    for _ in range(20):
        flat.observe(3, 5, 0.1)
    assert flat.fit() is None  # the drafted rows never varied: nothing says what a row costs
    # a window of held requests (no drafted rows) keeps the last fit: the planner keeps holding
    for _ in range(planner_mod.WINDOW):
        costs.observe(5, 0, 0.07)
    assert not costs.ready
    assert costs.fit() == pytest.approx((0.02, 0.01, 0.004), abs=1e-9)


def test_a_batch_held_for_a_whole_window_stays_held():
    """Cycles with nothing drafted fill the cost window; the planner keeps the fit it had and
    keeps holding, instead of letting every request draft in full again."""
    planner, controls = _planner(per_row=1.0)
    assert planner.plan(controls) == [0, 0, 0]
    for _ in range(planner_mod.WINDOW):
        planner.costs.observe(3, 0, 0.05)
    assert not planner.costs.ready and planner.choose(controls) == [0, 0, 0]


def _planner(per_row: float, accepted: float = 0.5) -> tuple[DepthPlanner, list[DepthControl]]:
    planner = DepthPlanner(3)
    rng = random.Random(0)
    for _ in range(20):
        e = rng.randint(0, 9)
        planner.costs.observe(3, e, 0.05 + per_row * e)
    controls = [DepthControl(drafted=[10, 8, 6], accepted=[int(10 * accepted), int(8 * accepted ** 2), 1])
                for _ in range(3)]
    return planner, controls


def test_the_planner_limits_a_batch_by_what_rows_cost():
    planner, controls = _planner(per_row=0.0)
    assert planner.plan(controls) == [None, None, None]
    planner, controls = _planner(per_row=1.0)
    assert planner.plan(controls) == [0, 0, 0]
    assert planner.plan(controls[:1]) == [None]  # alone, a request drafts as its stack says
    assert DepthPlanner(3).plan(controls) == [1, 1, 1]  # nothing measured yet: one position each
    assert DepthPlanner(3).plan(controls[:1]) == [None]


def test_a_request_held_to_plain_steps_looks_again():
    """A held request drafts one cycle in full every PROBE_EVERY cycles per request in the batch,
    and one request at most looks in a cycle: the batch probes about once every PROBE_EVERY cycles."""
    every = planner_mod.PROBE_EVERY
    planner, controls = _planner(per_row=1.0)
    seen = [planner.plan(controls[:2])[0] for _ in range(every * 4)]  # a batch of two
    assert seen.count(None) == 2 and seen[2 * every - 1] is None
    assert all(s == 0 for i, s in enumerate(seen) if (i + 1) % (2 * every))
    planner, controls = _planner(per_row=1.0)
    rounds = [planner.plan(controls) for _ in range(3 * every + 2)]  # three requests held together
    looks = [(i, r.index(None)) for i, r in enumerate(rounds) if None in r]
    assert all(r.count(None) <= 1 for r in rounds)
    assert looks == [(3 * every - 1, 0), (3 * every, 1), (3 * every + 1, 2)]  # one a cycle, in turn


def test_a_tree_cut_to_its_first_positions():
    tree = DraftTree.with_root(1)
    a = tree.add(0, 5, -0.1)
    b = tree.add(0, 6, -0.5)
    c = tree.add(a, 7, -0.2)
    tree.add(c, 8, -0.3)
    tree.draft_probs = {0: (None, torch.ones(2)), a: (None, torch.ones(1)), c: (None, torch.ones(1))}
    cut = tree.within(2)
    assert cut.tokens == [1, 5, 6, 7] and cut.parents == [-1, 0, 0, 1] and max(cut.depths) == 1
    assert set(cut.draft_probs) == {0, 1}  # the new leaf (7) proposes nothing any more
    assert tree.within(1).tokens == [1, 5, 6] and tree.within(0).tokens == [1]
    assert tree.within(9) is tree
    _ = b


def test_a_tree_cut_to_its_first_line():
    tree = DraftTree.with_root(1)
    a = tree.add(0, 5, -0.1)
    tree.add(0, 6, -0.5)
    c = tree.add(a, 7, -0.2)
    tree.add(a, 9, -0.4)
    tree.add(c, 8, -0.3)
    line = tree.line()
    assert line.is_chain and line.tokens == [1, 5, 7, 8] and line.depths == [-1, 0, 1, 2]
    assert line.line() is line


class _OldSession:
    """A plugin's session from before ``depth`` existed: it always drafts 4 tokens."""

    def grow(self, tokens, features, n, params, verifier, generator, stats):
        tree = DraftTree.with_root(int(tokens[n - 1]))
        node = 0
        for t in range(4):
            node = tree.add(node, 10 + t, 0.0)
        return tree


def test_a_session_without_depth_is_cut_and_built_ins_draft_no_deeper():
    from dynaspec.runtime.drafters import NGramSource
    from dynaspec.runtime.stats import GenerationStats

    tokens = torch.tensor([1, 2, 3, 1, 2, 3, 4, 5, 6, 1, 2])
    stats = GenerationStats()
    old = grow_within(_OldSession(), tokens, None, len(tokens), None, None, None, stats, 2)
    assert old.tokens == [2, 10, 11]
    session = NGramSource(min_ngram=1, max_ngram=3, tokens=5).start(64)

    class Greedy:
        prunes = True

    assert grow_within(session, tokens, None, len(tokens), None, Greedy(), None, stats, None).tokens == [2, 3, 4, 5,
                                                                                                       6, 1]
    assert grow_within(session, tokens, None, len(tokens), None, Greedy(), None, stats, 2).tokens == [2, 3, 4]


def _run_with_limits(engine, prompts, lengths, pick):
    """Generations interleaved as the server runs them, ``pick(cycle, i)`` setting each one's limit
    before it drafts; every pass is checked against its limit."""
    controls = [DepthControl() for _ in prompts]
    texts, _, _ = interleaved(engine, prompts, lengths, controls=controls, limits=pick)
    return texts, controls


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_limits_never_change_greedy_output(kind):
    engine = make_engine(kind, trained_drafter(kind), builtin_registry(), draft={"mode": "chain", "depth": 4,
                                                                                "min_confidence": 0.0})
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 99, (int(n),), generator=gen).tolist() for n in (5, 8, 3)]
    lengths = [30, 22, 26]
    rng = random.Random(kind)
    texts, controls = _run_with_limits(engine, prompts, lengths, lambda c, i: rng.choice([None, 0, 1, 2, 3]))
    assert texts == [engine.generate(p, max_new_tokens=n).text for p, n in zip(prompts, lengths)]
    for control in controls:  # the counts are per position, never rising with depth
        assert control.drafted and all(a <= d for a, d in zip(control.accepted, control.drafted))
        assert control.drafted == sorted(control.drafted, reverse=True)
    _, held = _run_with_limits(engine, prompts, lengths, lambda c, i: 0)
    assert all(not c.drafted for c in held)  # held to plain steps: nothing drafted


def test_a_tree_stack_in_a_batch_drafts_its_first_line_within_its_limit():
    # the batch planner grants positions, each a row of the shared pass: under a limit a tree stack
    # verifies the first line of its tree (at most limit + 1 rows, checked by interleaved), alone
    # (no limit) its tree; greedy output is the same either way
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(),
                         draft={"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 8}, exact="observed")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 99, (int(n),), generator=gen).tolist() for n in (6, 4)]
    lengths = [24, 20]
    rng = random.Random(3)
    from dynaspec.runtime.drafting import Drafting

    widths = []  # how many nodes the drafter expands at each depth after the first
    grow = Drafting.grow

    def counting(self, *args, **kwargs):
        tree = grow(self, *args, **kwargs)
        widths.append((kwargs.get("chain", args[10] if len(args) > 10 else False),
                       max((tree.depths.count(d) for d in range(len(tree))), default=0)))
        return tree

    Drafting.grow = counting
    try:
        texts, controls = _run_with_limits(engine, prompts, lengths, lambda c, i: rng.choice([1, 2, 3]))
        solo = [engine.generate(p, max_new_tokens=n).text for p, n in zip(prompts, lengths)]
    finally:
        Drafting.grow = grow
    assert texts == solo
    assert all(c.drafted for c in controls)
    # granted a limit, the drafter grows its first line alone (no siblings drafted only to be cut);
    # alone, the stack's tree
    batched, alone = [w for chain, w in widths if chain], [w for chain, w in widths if not chain]
    assert batched and alone and max(batched) == 1 and max(alone) > 1


def test_the_servers_worker_batches_with_limits_and_keeps_solo_outputs(monkeypatch):
    """The worker with a planner that holds every request to limits drawn at random: each answer
    is its solo answer, and the limits show in the metrics."""
    from dynaspec.serving.metrics import Metrics
    from dynaspec.serving.worker import Job, Worker

    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), draft={"mode": "chain", "depth": 3})
    rng = random.Random(7)
    monkeypatch.setattr(DepthPlanner, "choose", lambda self, controls: [rng.choice([0, 1, 2, None]) for _ in controls])
    metrics = Metrics()
    worker = Worker(engine, metrics, max_queue=8, max_batch=4)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 99, (int(n),), generator=gen).tolist() for n in (4, 7, 2, 9, 5, 3)]
    lengths = [20, 14, 25, 10, 18, 22]

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, n, 0.0, 1.0, None, (), loop) for p, n in zip(prompts, lengths)]
        worker.start()
        for job in jobs:
            worker.submit(job)
        texts = []
        for job in jobs:
            parts = []
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "done":
                    break
                else:
                    raise AssertionError(value)
            texts.append("".join(parts))
        await loop.run_in_executor(None, worker.stop, 10.0)
        return texts

    texts = asyncio.run(main())
    assert texts == [engine.generate(p, max_new_tokens=n).text for p, n in zip(prompts, lengths)]
    limits = {s.labels.get("le"): s.value for s in metrics.draft_limit.collect()[0].samples
              if s.name.endswith("_bucket")}
    assert limits["0.0"] > 0 and limits["3.0"] > limits["2.0"] > limits["0.0"]
    assert worker.planner._drafted[0] > 0  # the finished requests' drafts joined the pooled counts


def test_a_position_no_request_reached_is_not_written_off_and_grants_look_one_deeper():
    """Positions beyond every grant so far had a pooled share of 0, so no request was ever granted
    them and they were never measured; now they start from the unseen rate, and a request granted
    some positions but not all drafts one more every EXPLORE_EVERY-th such cycle."""
    from dynaspec.runtime.gate import EXPLORE_EVERY

    planner = DepthPlanner(3)
    controls = [DepthControl(drafted=[20], accepted=[12]) for _ in range(2)]  # only position 1 drafted
    rates = planner.acceptance(controls)
    assert (rates[:, 1] > 0).all() and (rates[:, 2] > 0).all()
    assert (np.diff(rates, axis=1) <= 0).all()
    planner.choose = lambda cs: [1, 0]  # a grant of one position to the first request, none to the second
    limits = [planner.plan(controls) for _ in range(2 * EXPLORE_EVERY)]
    assert [i for i, lim in enumerate(limits) if lim[0] == 2] == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert all(lim[0] in (1, 2) and lim[1] == 0 for lim in limits)
