"""scripts/drafter_offline.py: a drafter's chains on collected shards, offline, and the first
position's top-k hit rates that say what sibling branches of a tree could add."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
