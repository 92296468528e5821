"""dynaspec's own drafter with EAGLE-3-style fused features: the first draft step reads the inputs of
low and middle target layers beside the final hidden state (``train-drafter --feature-layers``). The
layer inputs are computed once per shard, the untrained fused drafter is the plain one, training and
``prepare`` write a drafter that loads with its layers, and decoding with it stays exact."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from conftest import reference_greedy, target
from dynaspec.errors import ConfigError
from dynaspec.runtime.drafter import Drafter, DrafterConfig
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.targets import load_drafter
from dynaspec.training import drafter as dt
from dynaspec.training.prepare import PrepareBudget, prepare
from dynaspec.training.shards import layer_inputs_path, load_shard, shard_paths


def test_the_final_layer_index_is_the_normed_final_hidden_state_and_others_are_refused():
    tgt = target("llama")
    count = len(tgt.decoder.layers)
    ids = torch.tensor([5, 6, 7, 8])
    hidden, fused = tgt.forward(ids, torch.arange(4), tgt.new_cache(8), layers=[0, count])
    d = tgt.hidden_size
    states = tgt.model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(fused[:, :d], states[0][0])  # the input of layer 0
    torch.testing.assert_close(fused[:, d:], hidden)  # index L: the normed final state itself
    with pytest.raises(ConfigError, match=rf"feature layers \[{count + 1}\] are not layers of this target"):
        tgt.forward(ids, torch.arange(4), tgt.new_cache(8), layers=[count + 1])


def test_an_untrained_fused_drafter_is_the_plain_drafter():
    """``fuse`` starts as the identity on the final state: what training adds comes from the lower layers."""
    tgt = target("llama")
    torch.manual_seed(0)
    plain = Drafter(DrafterConfig.like_target(tgt.model))
    fused = Drafter(attrs.evolve(plain.cfg, feature_layers=(0, 1, 2)))
    missing = fused.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["fuse.weight", "layer_norms.0.weight", "layer_norms.1.weight"]
    d = tgt.hidden_size
    emb, final = torch.randn(1, 5, d), torch.randn(1, 5, d)
    lower = torch.randn(1, 5, 2 * d) * 30  # residual streams are large; their norms tame them
    pos = torch.arange(1, 6)[None]
    torch.testing.assert_close(fused(emb, torch.cat([lower, final], -1), pos), plain(emb, final, pos))
    torch.testing.assert_close(fused(emb, final, pos), plain(emb, final, pos))  # deeper: own outputs


def test_training_with_fused_features(tmp_path):
    """Layer inputs are computed once per shard (what the target computes), training reads them, the
    drafter records its layers and loads with them; bad layers are refused before any work."""
    from dynaspec.training import collect as dc

    tgt = target("llama")
    work = tmp_path / "work"
    gen = torch.Generator().manual_seed(0)
    prompts = [(f"p{k}", torch.randint(3, 99, (6,), generator=gen).tolist()) for k in range(6)]
    original = dc._prompt_batches
    dc._prompt_batches = lambda tokenizer, start, count, *a, **k: prompts[start:start + count]
    try:
        dc.collect(tgt, work, prompts=6, shard_size=3, batch=3, new_tokens=16)
    finally:
        dc._prompt_batches = original
    kwargs = dict(window=16, batch_positions=64, unroll=2, frequent=16, steps=6, checkpoint_every=2)
    with pytest.raises(ValueError, match=r"feature layers \[0, 5\] must lie in 0..1"):
        dt.train(tgt, work, tmp_path / "bad", feature_layers=[5, 0], **kwargs)
    drafter = dt.train(tgt, work, tmp_path / "fused", feature_layers=[0], **kwargs)
    count = len(tgt.decoder.layers)
    assert drafter.feature_layers == (0, count) and drafter.meta["training"]["feature_layers"] == [0, count]
    for path in shard_paths(work):
        shard, inputs = load_shard(path), load_shard(layer_inputs_path(path, (0,)))["inputs"]
        offs = shard["offsets"].tolist()
        seq = shard["tokens"][offs[0]:offs[1]].long()
        expected = tgt.forward(seq, torch.arange(len(seq)), tgt.new_cache(len(seq) + 1), layers=[0])[1]
        torch.testing.assert_close(inputs[: len(seq)].float(), expected.float(), atol=0.05, rtol=0.02)
        assert inputs.shape == (shard["tokens"].numel(), tgt.hidden_size)
    stamps = [layer_inputs_path(p, (0,)).stat().st_mtime_ns for p in shard_paths(work)]
    dt.train(tgt, work, tmp_path / "again", feature_layers=[0], **kwargs)  # computed once
    assert stamps == [layer_inputs_path(p, (0,)).stat().st_mtime_ns for p in shard_paths(work)]
    assert json.loads((tmp_path / "fused" / "drafter.json").read_text())["architecture"]["feature_layers"] == [0, 2]
    loaded = load_drafter(str(tmp_path / "fused"), tgt)
    assert loaded.feature_layers == (0, count) and loaded.cfg == drafter.cfg
    assert drafter.fuse.weight[:, : tgt.hidden_size].abs().max() > 0  # it learned to read layer 0


def test_collection_writes_the_layer_inputs_in_the_same_pass(tmp_path, monkeypatch):
    """Collected with ``feature_layers``, each shard's layer inputs are written beside it (as
    training would compute them), so training runs no second pass of the target; bad layers are
    refused before any work."""
    from dynaspec.training import collect as dc

    tgt = target("llama")
    gen = torch.Generator().manual_seed(1)
    prompts = [(f"p{k}", torch.randint(3, 99, (5,), generator=gen).tolist()) for k in range(4)]
    monkeypatch.setattr(dc, "_prompt_batches", lambda tokenizer, start, count, *a, **k: prompts[start:start + count])
    count = len(tgt.decoder.layers)
    with pytest.raises(ConfigError, match=r"feature layers \[0, 2\] must lie in 0..1"):
        dc.collect(tgt, tmp_path / "bad", prompts=4, shard_size=2, new_tokens=8, feature_layers=(2, 0))
    assert not (tmp_path / "bad").exists() or not shard_paths(tmp_path / "bad")
    work = tmp_path / "work"
    dc.collect(tgt, work, prompts=4, shard_size=2, batch=2, new_tokens=8, feature_layers=(1, 0))
    for path in shard_paths(work):
        written = load_shard(path, (0, 1))["layer_inputs"]
        shard = load_shard(path)
        offs = shard["offsets"].tolist()
        expected = torch.cat([tgt.fused_features(shard["tokens"][a:b].long(), (0, 1))
                              for a, b in zip(offs[:-1], offs[1:])])
        assert written.shape == (shard["tokens"].numel(), 2 * tgt.hidden_size) and count == 2
        torch.testing.assert_close(written.float(), expected.float(), atol=0.05, rtol=0.02)
    stamps = [layer_inputs_path(p, (0, 1)).stat().st_mtime_ns for p in shard_paths(work)]
    dt.train(tgt, work, tmp_path / "d", feature_layers=[0, 1], window=16, batch_positions=32, unroll=2,
             frequent=16, steps=2, checkpoint_every=2)
    assert stamps == [layer_inputs_path(p, (0, 1)).stat().st_mtime_ns for p in shard_paths(work)]


def test_prepare_with_fused_features_is_exact(tmp_path):
    """``prepare --feature-layers``: the drafter reads fused layers, its router is trained on what it
    sees at draft time, and the stack decodes exactly what the target decodes."""
    budget = PrepareBudget(prompts=16, source="generated", shard_size=4, new_tokens=32, steps=300,
                           batch_positions=256, router_width=32, drafter_width=48, feature_layers=(0,))
    prepare("tiny-llama", tmp_path / "out", budget=budget, command="t")
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["budget"]["feature_layers"] == [0]
    spec = Engine.from_stack(str(tmp_path / "out" / "stack.toml"))
    assert spec.drafter.feature_layers == (0, 2) and spec.stack.shortlister.name == "dynaspec"
    accepted = []
    for prompt in ([5, 6, 7, 8], [30, 31, 9], [11, 12, 13, 14, 15]):
        result = spec.generate(prompt, max_new_tokens=24)
        assert result.token_ids == reference_greedy("llama", prompt, 24)
        accepted.append(result.stats.mean_accepted_length)
    assert max(accepted) > 1.5  # it drafts (the tiny target's greedy text is easy to learn)
    tree = Engine.from_stack(str(tmp_path / "out" / "stack.toml"),
                             overrides={"draft": {"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 12},
                                        "exact": "observed"})  # a tree is compared, not guaranteed
    assert tree.generate([5, 6, 7, 8], max_new_tokens=24).token_ids == reference_greedy("llama", [5, 6, 7, 8], 24)
    # the router read the lower layers' inputs that training left beside the shards: the same
    # examples as recomputing the fused features from the tokens
    from dynaspec.training.router import router_examples

    drafter, tgt = spec.drafter.float(), spec.target
    path = shard_paths(tmp_path / "out" / "work")[0]
    assignment = torch.arange(tgt.vocab_size) % 7

    def fused(seq):
        return tgt.forward(seq, torch.arange(len(seq)), tgt.new_cache(len(seq) + 1), layers=drafter.feature_layers)[1]

    _, read, labels = router_examples(load_shard(path, (0,)), tgt.embed, assignment, drafter)
    _, recomputed, same = router_examples(load_shard(path), tgt.embed, assignment, drafter, fused=fused)
    assert torch.equal(labels, same) and len(labels) > 0
    torch.testing.assert_close(read, recomputed, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_pass_for_the_last_position_alone_computes_its_output_and_the_same_cache(kind):
    """``last=True`` (a first draft over the prompt, a catch-up over committed tokens): every
    position's key and value enter the cache as in the full pass, and the last position's output
    is the full pass's last row; with a mask, the mask's last row applies."""
    from dynaspec.runtime.drafter import DraftCache

    tgt = target(kind)
    torch.manual_seed(0)
    drafter = Drafter(attrs.evolve(DrafterConfig.like_target(tgt.model), feature_layers=(0, 2)))
    assert drafter.cfg.qk_norm == (kind == "gemma3")
    d = tgt.hidden_size
    caches = DraftCache(32), DraftCache(32)
    early = torch.randn(1, 3, d), torch.randn(1, 3, 2 * d), torch.arange(1, 4)[None]
    for cache in caches:  # some context already cached
        drafter(*early, cache=cache)
    emb, feats, pos = torch.randn(1, 6, d), torch.randn(1, 6, 2 * d), torch.arange(4, 10)[None]
    full = drafter(emb, feats, pos, cache=caches[0])
    last = drafter(emb, feats, pos, cache=caches[1], last=True)
    assert last.shape == (1, 1, d)
    torch.testing.assert_close(last, full[:, -1:])
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    mask = torch.ones(6, 9, dtype=torch.bool).tril(3)
    mask[-1, 4] = False  # the last row does not see one of the new positions
    for cache in caches:
        cache.crop(3)
    full = drafter(emb, feats, pos, cache=caches[0], mask=mask)
    last = drafter(emb, feats, pos, cache=caches[1], mask=mask, last=True)
    torch.testing.assert_close(last, full[:, -1:])
