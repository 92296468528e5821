"""scripts/drafter_offline.py: a drafter's chains on collected shards, offline, and the first
position's top-k hit rates that say what sibling branches of a tree could add."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.drafter import Drafter, DrafterConfig
from dynaspec.training import collect as dc
from dynaspec.training.shards import load_shard

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "drafter_offline.py"
TEXTS = ["Hello there, how are you?", "Write a poem about the sea.", "def f(x): return x * 2"]


def _script():
    spec = importlib.util.spec_from_file_location("drafter_offline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_position_top_k_agrees_with_the_chains(tmp_path, monkeypatch):
    monkeypatch.setattr(dc, "_prompt_batches", lambda tokenizer, start, count, max_prompt_tokens, *a, **k: [
        (f"id{i}", tokenizer(TEXTS[i])["input_ids"]) for i in range(start, min(start + count, len(TEXTS)))])
    target = tiny_target("llama")
    [path] = dc.collect(target, tmp_path, prompts=3, shard_size=3, batch=3, new_tokens=12)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.like_target(target.model)).float().eval()
    vocab = target.lm_head_weight.shape[0]
    got = _script().chain_acceptance(target, drafter, load_shard(path), depth=3, every=1, topk=vocab)
    chains = len(got["lengths"])
    assert chains > 0 and got["reached"][0] == chains
    hits = got["top_hits"]
    # a chain's first token is the drafter's likeliest: its top-1 hits are the chains accepted there
    assert hits[0] == got["accepted"][0]
    assert all(a <= b for a, b in zip(hits, hits[1:]))  # more candidates never catch fewer
    assert hits[-1] == chains  # the whole vocabulary always holds the target's token


def test_drafter_inputs_reports_each_half_of_fc_and_the_embedding_norm_rescales_the_token(tmp_path, monkeypatch,
                                                                                            capsys):
    """scripts/drafter_inputs.py: the RMS of fc's token and feature parts on a shard's positions. A
    drafter given an embedding norm at the embeddings' typical RMS reads the same token part (up to
    each token's distance from it); without the norm the token part follows the embedding's scale."""
    from conftest import trained_drafter
    from dynaspec.runtime.targets import load_target
    from dynaspec.training.drafter import embedding_rms, with_embed_norm

    monkeypatch.setattr(dc, "_prompt_batches", lambda tokenizer, start, count, max_prompt_tokens, *a, **k: [
        (f"id{i}", tokenizer(TEXTS[i])["input_ids"]) for i in range(start, min(start + count, len(TEXTS)))])
    target = load_target("tiny-llama")
    dc.collect(target, tmp_path / "work", prompts=3, shard_size=3, batch=3, new_tokens=12)
    plain = trained_drafter("llama").float()
    plain.save(tmp_path / "plain")
    with_embed_norm(plain, embedding_rms(target)).save(tmp_path / "normed")
    spec = importlib.util.spec_from_file_location("drafter_inputs", SCRIPT.parent / "drafter_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--target", "tiny-llama", "--work", str(tmp_path / "work"), "--drafter",
                        str(tmp_path / "plain"), str(tmp_path / "normed")]) == 0
    out = capsys.readouterr().out
    rows = {r[0].strip(): [float(x) for x in r[1:]] for r in
            (line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "RMS" not in line)}
    assert set(rows) == {"plain", "normed"}
    for final, token, feature, ratio in rows.values():
        assert final > 0 and token > 0 and feature > 0 and ratio == pytest.approx(token / feature, abs=2e-3)
    assert rows["normed"][1] == pytest.approx(rows["plain"][1], rel=0.1)
    assert rows["normed"][2] == pytest.approx(rows["plain"][2], rel=1e-3)  # the features' part is untouched
    emb, feats = torch.randn(5, plain.cfg.hidden_size), torch.randn(5, plain.cfg.hidden_size)
    assert module.fc_parts(plain, emb * 10, feats)[0] == pytest.approx(10 * module.fc_parts(plain, emb, feats)[0])
    normed = with_embed_norm(plain, 1.0)
    assert module.fc_parts(normed, emb * 10, feats)[0] == pytest.approx(module.fc_parts(normed, emb, feats)[0],
                                                                       rel=1e-4)
