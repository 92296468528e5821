"""Several generations verified in shared passes of the target (``TargetModel.forward_many``, the
server's continuous batching): every sequence's rows are the rows it gets alone, bit for bit, so
each generation's output is its solo output whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BACKEND,
    builtin_registry,
    interleaved,
    make_engine,
    random_drafter,
    target,
    trained_drafter,
)
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.target import TargetPass


def _filled(tgt, prompt: list[int]):
    cache = tgt.new_cache(64)
    tgt.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    return cache


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_each_sequences_rows_in_a_shared_pass_are_its_rows_alone(kind):
    tgt = target(kind)
    tgt.make_batch_invariant()
    prompts = [[5, 9, 31, 7], [11, 3, 8, 60, 21, 4, 70, 13, 2, 44], [17, 18]]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    shapes = [dict(ids=[40], chain=False, mask=None),  # a plain step
              dict(ids=[6, 12, 50, 9], chain=True, mask=None),  # a chain's verification
              dict(ids=[33, 34, 35], chain=False, mask=tree)]  # a tree's
    layers = [1, len(tgt.decoder.layers)]  # and the fused features a drafter reads

    def passes():
        out = []
        for prompt, shape in zip(prompts, shapes):
            n = len(shape["ids"])
            depths = torch.tensor([0, 1, 1]) if shape["mask"] is not None else torch.arange(n)
            out.append(TargetPass(torch.tensor(shape["ids"]), len(prompt) + depths, _filled(tgt, prompt),
                                  tree_mask=shape["mask"], chain=shape["chain"], layers=layers,
                                  head=[0, 1] if shape["mask"] is not None else list(range(n))))
        return out

    alone = passes()
    for p in alone:
        tgt.forward_many([p])
    together = passes()
    tgt.forward_many(together)
    for a, b in zip(alone, together):
        assert torch.equal(a.result[0], b.result[0]) and torch.equal(a.result[1], b.result[1])
        assert a.cache.get_seq_length() == b.cache.get_seq_length()
        # the head rows, from products shared by the three, are each one's own head product
        assert a.logits is None and torch.equal(b.logits, tgt.logits(a.result[0][a.head]))
    # the caches hold the same keys as well: the next plain step of each is the same too
    nxt = [TargetPass(torch.tensor([3]), torch.tensor([int(p.positions.max()) + 1]), p.cache) for p in together]
    tgt.forward_many(nxt)
    for p, q in zip(nxt, [TargetPass(torch.tensor([3]), torch.tensor([int(p.positions.max()) + 1]), p.cache)
                          for p in alone]):
        tgt.forward_many([q])
        assert torch.equal(p.result, q.result)


def test_a_pass_that_raises_fails_alone():
    tgt = target("llama")
    tgt.make_batch_invariant()
    good = [TargetPass(torch.tensor([7]), torch.tensor([4]), _filled(tgt, [5, 9, 31, 7])) for _ in range(2)]
    bad = TargetPass(torch.tensor([10 ** 6]), torch.tensor([2]), _filled(tgt, [1, 2]))  # no such token
    tgt.forward_many([good[0], bad, good[1]])
    assert isinstance(bad.error, IndexError)
    with pytest.raises(IndexError):
        bad.output()
    solo = TargetPass(torch.tensor([7]), torch.tensor([4]), _filled(tgt, [5, 9, 31, 7]))
    tgt.forward_many([solo])
    for p in good:  # their caches were set back and their rows computed again, alone
        assert p.error is None and torch.equal(p.output(), solo.result)
        assert p.cache.get_seq_length() == 5


def test_passes_beyond_the_probed_row_count_are_split(monkeypatch):
    tgt = target("llama")
    tgt.make_batch_invariant()
    calls = []
    lean = tgt._lean_decoder()
    real = lean.forward_many
    monkeypatch.setattr(lean, "forward_many", lambda ids, *a, **k: calls.append(len(ids)) or real(ids, *a, **k))
    monkeypatch.setattr(tgt, "max_pass_rows", 8)
    passes = [TargetPass(torch.tensor([7, 8, 9]), torch.tensor([4, 5, 6]), _filled(tgt, [5, 9, 31, 7]), chain=True)
              for _ in range(5)]
    tgt.forward_many(passes)
    assert calls == [6, 6, 3] and all(p.result.shape[0] == 3 for p in passes)
    # with kernels probed at some row counts only, a group holds one of those counts (or one pass)
    calls.clear()
    monkeypatch.setattr(tgt, "max_pass_rows", 64)
    monkeypatch.setattr(tgt, "pass_rows", frozenset({1, 2, 4, 8}))
    passes = [TargetPass(torch.tensor([7] * n), torch.arange(4, 4 + n), _filled(tgt, [5, 9, 31, 7]), chain=n > 1)
              for n in (3, 1, 2, 2, 5)]
    tgt.forward_many(passes)
    assert calls == [8, 5] and [p.result.shape[0] for p in passes] == [3, 1, 2, 2, 5]


STACKS = [
    dict(draft={"mode": "chain", "depth": 4}),
    dict(draft={"mode": "chain", "depth": 3, "adaptive": True},
         drafter={"name": "composite", "drafters": [{"name": "ngram", "min_ngram": 1}, "in-memory"]}),
    dict(draft={"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 10}),
    dict(draft={"mode": "chain", "depth": 3}, decode={"temperature": 0.8}),
]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("fields", STACKS, ids=["chain", "lookup+chain-adaptive", "tree", "sampling"])
def test_generations_batched_together_give_their_solo_outputs(kind, fields):
    data = {"name": "test", "target": f"tiny-{kind}", "drafter": "in-memory", "backend": BACKEND, **fields}
    engine = Engine(stack_from_mapping(data), target(kind), trained_drafter(kind), registry=builtin_registry())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 99, (int(n),), generator=gen).tolist() for n in (4, 9, 2, 6, 12)]
    lengths = [30, 12, 40, 25, 18]
    kwargs = {"seed": 5} if fields.get("decode") else {}
    texts, sizes, stats = interleaved(engine, prompts, lengths, **kwargs)
    assert max(sizes) == len(prompts) and sizes[-1] < len(prompts)  # batched, and generations left
    for prompt, n, text, st in zip(prompts, lengths, texts, stats):
        solo = engine.generate(prompt, max_new_tokens=n, **kwargs)
        assert text == solo.text and st.new_tokens == solo.stats.new_tokens
        if not fields["draft"].get("adaptive"):  # (the gate drafts by measured times, not the same twice)
            assert st.accepted_lengths == solo.stats.accepted_lengths  # the same drafts, accepted alike


def test_plain_decoding_batched_and_a_random_drafter_batched():
    for drafter in (None, random_drafter("llama")):
        engine = make_engine("llama", drafter, builtin_registry(), draft={"mode": "chain", "depth": 5})
        prompts = [[5, 9, 31, 7], [8], [40, 41, 42, 43, 44, 45]]
        texts, sizes, _ = interleaved(engine, prompts, [50, 20, 35])
        assert max(sizes) == 3
        assert texts == [engine.generate(p, max_new_tokens=n).text for p, n in zip(prompts, [50, 20, 35])]


def test_a_pass_error_reaches_its_own_generation(monkeypatch):
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), draft={"mode": "chain", "depth": 3})
    from dynaspec.runtime.drafting import DraftPass

    gen = engine.stream_passes([5, 9, 31, 7], max_new_tokens=10)
    for step in gen:  # the drafter's calls run as they come; the first target pass fails
        if isinstance(step, TargetPass):
            break
        if isinstance(step, DraftPass):
            step.run()
    step.error = RuntimeError("this pass failed")
    with pytest.raises(RuntimeError, match="this pass failed"):
        next(gen)


def _draft_calls(drafter, specs, seed):
    """Two identical sets of drafter calls (each over its own cache holding 5 earlier rows): one
    to run alone, one to run together."""
    from dynaspec.runtime.drafter import DraftCache
    from dynaspec.runtime.drafting import DraftPass

    d, gen = drafter.cfg.hidden_size, torch.Generator().manual_seed(seed)
    sets = ([], [])
    for rows, last, tree in specs:
        first_e, first_f = torch.randn(5, d, generator=gen), torch.randn(5, d, generator=gen)
        emb, feats = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen)
        mask = None
        if tree:  # siblings: each row sees the context and itself
            mask = torch.ones(rows, 5 + rows, dtype=torch.bool)
            mask[:, 5:] = torch.eye(rows, dtype=torch.bool)
        positions = torch.full((rows,), 5) if tree else torch.arange(5, 5 + rows)
        for calls in sets:
            cache = DraftCache(32)
            drafter(first_e[None], first_f[None], torch.arange(5)[None], cache=cache)
            calls.append(DraftPass(drafter, emb, feats, positions, cache, mask=mask, last=last))
    return sets


def test_drafter_calls_of_several_drafts_together_equal_each_alone():
    # a server's batch: each draft step's drafter calls of every request in one forward_many (the
    # products once over all rows), each attending over its own cache: the outputs and caches of
    # each call alone, to float rounding (drafts only propose: verification decides the output)
    from dynaspec.runtime.drafting import run_draft_passes

    drafter = trained_drafter("llama")
    assert drafter.batches_calls
    with torch.inference_mode():
        alone, together = _draft_calls(drafter, [(3, True, False), (1, False, False), (2, False, True),
                                                 (4, True, False), (1, False, False)], seed=1)
        for p in alone:
            p.run()
        run_draft_passes(together)
    for a, b in zip(alone, together):
        assert a.result.shape == b.result.shape == ((1 if a.last else len(a.emb)), drafter.cfg.hidden_size)
        assert torch.allclose(a.result, b.result, atol=1e-5, rtol=1e-5)
        assert b.cache.length == a.cache.length == 5 + len(a.emb)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.cache.views(), b.cache.views()))
        assert b.seconds > 0 and b.share == pytest.approx(b.seconds / len(together))


def test_a_failing_drafter_call_fails_alone_and_other_drafters_run_one_by_one():
    from dynaspec.runtime.drafting import run_draft_passes
    from dynaspec.runtime.eagle import Eagle3Drafter

    drafter = trained_drafter("llama")
    with torch.inference_mode():
        alone, together = _draft_calls(drafter, [(2, True, False), (1, False, False), (3, False, False)], seed=2)
        bad = together[1]
        bad.feats = bad.feats[:, :-1]  # a wrong width: its call fails, the others' are computed
        for p in alone:
            p.run()
        run_draft_passes(together)
    assert bad.error is not None and bad.result is None and bad.cache.length == 5
    with pytest.raises(RuntimeError):
        bad.output()
    for i in (0, 2):
        assert together[i].error is None and torch.allclose(together[i].output(), alone[i].result, atol=1e-5)
    # a drafter class with a forward of its own (EAGLE-3's) runs its calls one by one
    assert drafter.batches_calls and not Eagle3Drafter.__new__(Eagle3Drafter).batches_calls
