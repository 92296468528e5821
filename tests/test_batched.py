"""Several generations verified in shared passes of the target (``TargetModel.forward_many``, the
server's continuous batching): every sequence's rows are the rows it gets alone, bit for bit, so
each generation's output is its solo output whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BACKEND,
    alone_and_together,
    builtin_registry,
    interleaved,
    make_engine,
    random_drafter,
    target,
    tiny_target,
    trained_drafter,
)
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.target import TargetPass


def _filled(tgt, prompt: list[int]):
    cache = tgt.new_cache(64)
    if prompt:
        tgt.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    return cache


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_each_sequences_rows_in_a_shared_pass_are_its_rows_alone(kind):
    tgt = target(kind)
    tgt.make_batch_invariant()
    # the last two are prompts over empty caches: prefills in the others' pass
    prompts = [[5, 9, 31, 7], [11, 3, 8, 60, 21, 4, 70, 13, 2, 44], [17, 18], [], []]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    shapes = [dict(ids=[40], chain=False, mask=None),  # a plain step
              dict(ids=[6, 12, 50, 9], chain=True, mask=None),  # a chain's verification
              dict(ids=[33, 34, 35], chain=False, mask=tree),  # a tree's
              dict(ids=[8, 91, 23, 4, 66, 5, 70], chain=False, mask=None),  # a prefill
              dict(ids=[30, 2, 19], chain=False, mask=None)]  # another
    layers = [1, len(tgt.decoder.layers)]  # and the fused features a drafter reads

    def passes():
        out = []
        for prompt, shape in zip(prompts, shapes):
            n = len(shape["ids"])
            depths = torch.tensor([0, 1, 1]) if shape["mask"] is not None else torch.arange(n)
            head = [0, 1] if shape["mask"] is not None else [n - 1] if not prompt else list(range(n))
            out.append(TargetPass(torch.tensor(shape["ids"]), len(prompt) + depths, _filled(tgt, prompt),
                                  tree_mask=shape["mask"], chain=shape["chain"], layers=layers, head=head))
        return out

    alone, together = alone_and_together(tgt, passes)
    assert [p.is_prefill for p in together] == [False, False, False, True, True]
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


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_prefill_in_a_shared_pass_runs_on_the_prefill_kernels(kind):
    """A prompt's rows in a shared pass are computed on the prefill kernels, as its prefill alone,
    and the steps beside them on the strict ones: here the prefill kernels are made to give other
    bits than the steps' so that a mix-up would show."""
    tgt = tiny_target(kind)  # its own: the kernels are changed below
    tgt.make_batch_invariant()
    for layer in tgt._lean_decoder().layers:  # the prefill kernels, marked
        for name in ("qkv", "o", "gate_up", "down"):
            kernels = getattr(layer, name)
            setattr(layer, name, (*kernels[:2], lambda x, fn=kernels[2]: fn(x) + 2.0 ** -6))
    prompt, other = [8, 91, 23, 4, 66, 5, 70], [5, 9, 31, 7]
    strict = tgt._lean_decoder().forward_many(torch.tensor(prompt), torch.arange(7),
                                              [(tgt.new_cache(64), 7, None, True)])[0]
    assert not torch.equal(strict, tgt.forward(torch.tensor(prompt), torch.arange(7), tgt.new_cache(64)))

    def passes():
        return [TargetPass(torch.tensor([40, 41, 42]), 4 + torch.arange(3), _filled(tgt, other), chain=True),
                TargetPass(torch.tensor(prompt), torch.arange(7), tgt.new_cache(64)),
                TargetPass(torch.tensor([12]), torch.tensor([4]), _filled(tgt, other))]

    alone, together = alone_and_together(tgt, passes)
    for a, b in zip(alone, together):
        assert torch.equal(a.result, b.result)


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
    gen = engine.stream_passes([5, 9, 31, 7], max_new_tokens=10)
    step = next(item for item in gen if isinstance(item, TargetPass))
    step.error = RuntimeError("this pass failed")
    with pytest.raises(RuntimeError, match="this pass failed"):
        next(gen)
