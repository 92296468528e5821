"""Collection through the lean forward (``set_up_target`` then ``collect``): the sequences of a
shard step together through ``TargetModel.forward_many``, and what is written is what the target
gives for each prompt alone: its greedy continuation, cut after its end-of-turn token, and the
features of a pass over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from dynaspec.plugins.tiny import tiny_target
from dynaspec.training import collect as dc
from dynaspec.training.shards import load_shard

PROMPTS = [[5, 17, 23, 9], [44, 3], [8, 8, 61, 12, 90, 7, 33], [70, 21, 4], [13]]


@pytest.fixture
def prompts(monkeypatch):
    def prompt_batches(tokenizer, start, count, max_prompt_tokens, split="train", slice_name=None, fmt=None,
                       turns="first"):
        return [(f"id{k}", PROMPTS[k][:max_prompt_tokens]) for k in range(start, min(start + count, len(PROMPTS)))]

    monkeypatch.setattr(dc, "_prompt_batches", prompt_batches)


def _ready(kind: str = "llama"):
    tgt = tiny_target(kind)
    assert not dc.batched_generation(tgt)  # one sequence a pass until the probe has run
    assert dc.set_up_target(tgt, "auto") == "dtype"  # nobody measured the tiny targets' weights
    assert dc.batched_generation(tgt)
    return tgt


def _solo_greedy(tgt, prompt: list[int], n: int) -> list[int]:
    out = tgt.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_lean_collection_writes_each_prompts_own_greedy_continuation_and_its_features(tmp_path, prompts, kind):
    tgt = _ready(kind)
    calls = []
    forward_many = tgt.forward_many
    tgt.forward_many = lambda passes, **kw: (calls.append(len(passes)), forward_many(passes, **kw))[1]
    paths = dc.collect(tgt, tmp_path / "w", prompts=5, shard_size=5, new_tokens=10, feature_layers=(1,))
    assert max(calls) == 5  # the shard's sequences stepped together
    shard = load_shard(paths[0], (1,))
    offs, plens = shard["offsets"].tolist(), shard["prompt_lens"].tolist()
    written = {}
    for row, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        tokens = shard["tokens"][a:b].tolist()
        written[tuple(tokens[:plens[row]])] = tokens[plens[row]:]
        with torch.inference_mode():
            hidden, inputs = tgt.forward(torch.tensor(tokens), torch.arange(len(tokens)),
                                         tgt.new_cache(len(tokens) + 1), layers=(1,))
        # features as a pass over the whole sequence gives them (row sets differ: rounding only)
        torch.testing.assert_close(shard["features"][a:b].float(), hidden.float(), atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(shard["layer_inputs"][a:b].float(), inputs.float(), atol=2e-3, rtol=1e-2)
    assert set(written) == {tuple(p) for p in PROMPTS}
    for prompt in PROMPTS:
        assert written[tuple(prompt)] == _solo_greedy(tgt, prompt, 10)
    assert load_shard(paths[0])  # the shard alone loads too (its layer inputs beside it)


def test_a_sequence_that_ends_leaves_the_batch_after_its_end_token(tmp_path, prompts, monkeypatch):
    tgt = _ready()
    stop = _solo_greedy(tgt, PROMPTS[0], 12)[3]  # the 4th token of the first prompt's answer ends it
    monkeypatch.setattr(type(tgt), "eos_token_ids", property(lambda self: (stop,)))
    rows = []
    forward_many = tgt.forward_many
    tgt.forward_many = lambda passes, **kw: (rows.append(len(passes)), forward_many(passes, **kw))[1]
    made = dc._generate_lean(tgt, PROMPTS, 12)
    for prompt, (cont, hidden, inputs) in zip(PROMPTS, made):
        full = _solo_greedy(tgt, prompt, 12)
        cut = full[:full.index(stop) + 1] if stop in full else full
        assert cont == cut
        assert hidden.shape[0] == len(prompt) + len(cont) and inputs is None
    assert rows[0] == len(PROMPTS) and rows[-1] < len(PROMPTS)  # the finished ones left the batch


def test_lean_sampled_continuations_are_reproducible_per_seed_and_keep_the_teacher(tmp_path, prompts):
    tgt = _ready()
    kwargs = dict(prompts=5, shard_size=5, new_tokens=10)
    one = dc.collect(tgt, tmp_path / "s1", temperature=1.0, seed=1, **kwargs)
    again = dc.collect(tgt, tmp_path / "s1-again", temperature=1.0, seed=1, **kwargs)
    two = dc.collect(tgt, tmp_path / "s2", temperature=1.0, seed=2, **kwargs)
    greedy = dc.collect(tgt, tmp_path / "greedy", **kwargs)
    tokens = [load_shard(p[0])["tokens"].tolist() for p in (one, again, two, greedy)]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2] and tokens[0] != tokens[3]
    shard = load_shard(one[0])
    with torch.inference_mode():
        argmax = tgt.logits(shard["features"].to(tgt.dtype)).argmax(-1)
    assert torch.equal(shard["teacher"].long(), argmax)
    assert load_shard(one[0], ())["features"].shape[0] == len(tokens[0])
