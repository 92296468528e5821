"""Sampled continuations (``train-drafter --stage collect --temperature T --seed S``): more text
from the same train prompts, reproducible per seed, with the target's greedy next token stored as
the teacher, and a folder that refuses shards of another seed or temperature."""

from __future__ import annotations

import pytest
import torch

from dynaspec.errors import ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.training import collect as dc
from dynaspec.training.shards import describe_shards, load_shard, shard_kind

TEXTS = ["Hello there, how are you?", "Write a poem about the sea.", "Bonjour, comment allez-vous ?",
         "Explain gravity simply."]


@pytest.fixture
def prompts(monkeypatch):
    def prompt_batches(tokenizer, start, count, max_prompt_tokens, split="train", slice_name=None, fmt=None,
                       turns="first"):
        return [(f"id{k}", tokenizer(TEXTS[k])["input_ids"][:max_prompt_tokens])
                for k in range(start, min(start + count, len(TEXTS)))]

    monkeypatch.setattr(dc, "_prompt_batches", prompt_batches)


def _tokens(paths):
    return [load_shard(p)["tokens"].tolist() for p in paths]


def test_sampled_continuations_are_reproducible_per_seed_and_store_the_greedy_teacher(tmp_path, prompts):
    tgt = tiny_target("llama")
    kwargs = dict(prompts=4, shard_size=2, batch=2, new_tokens=12)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    one = dc.collect(tgt, tmp_path / "s1", temperature=1.0, seed=1, **kwargs)
    assert torch.equal(torch.rand(3), expected)  # the caller's random state is untouched
    again = dc.collect(tgt, tmp_path / "s1-again", temperature=1.0, seed=1, **kwargs)
    two = dc.collect(tgt, tmp_path / "s2", temperature=1.0, seed=2, **kwargs)
    greedy = dc.collect(tgt, tmp_path / "greedy", **kwargs)
    assert _tokens(one) == _tokens(again)
    assert _tokens(one) != _tokens(two) and _tokens(one) != _tokens(greedy)
    assert "teacher" not in load_shard(greedy[0])

    sampled_somewhere = False
    for path in one:
        shard = load_shard(path)
        tokens, offs, teacher = shard["tokens"].long(), shard["offsets"].tolist(), shard["teacher"].long()
        for row, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
            with torch.inference_mode():
                argmax = tgt.model(input_ids=tokens[a:b][None]).logits[0].argmax(-1)
            assert torch.equal(teacher[a:b], argmax)  # the target's greedy choice at every position
            plen = int(shard["prompt_lens"][row])
            sampled_somewhere |= not torch.equal(teacher[a + plen - 1:b - 1], tokens[a + plen:b])
    assert sampled_somewhere  # the continuations are not the greedy ones

    assert shard_kind(one[0])["sampling"] == "temperature 1, seed 1"
    assert shard_kind(greedy[0])["sampling"] == "greedy"
    assert "continuations (2 of them sampled" in describe_shards(one + greedy)["data"]
    assert "the target's greedy continuations" in describe_shards(greedy)["data"]


def test_sampled_collection_refuses_other_seeds_in_a_folder_and_bad_settings(tmp_path, prompts):
    tgt = tiny_target("llama")
    dc.collect(tgt, tmp_path / "s1", prompts=2, shard_size=2, batch=2, new_tokens=4, temperature=0.7, seed=1)
    with pytest.raises(ConfigError, match="sampling=temperature 0.7, seed 1 .asked: temperature 0.7, seed 2."):
        dc.collect(tgt, tmp_path / "s1", prompts=4, shard_size=2, batch=2, new_tokens=4, temperature=0.7, seed=2)
    with pytest.raises(ConfigError, match="asked: greedy"):
        dc.collect(tgt, tmp_path / "s1", prompts=4, shard_size=2, batch=2, new_tokens=4)
    with pytest.raises(ConfigError, match="--source generated"):
        dc.collect(tgt, tmp_path / "raw", prompts=2, shard_size=2, source="raw", temperature=0.7)
    with pytest.raises(ConfigError, match="above 0"):
        dc.collect(tgt, tmp_path / "neg", prompts=2, shard_size=2, temperature=-1.0)
    assert not (tmp_path / "raw").exists() and not (tmp_path / "neg").exists()


def test_cli_refuses_a_temperature_for_raw_text_before_loading_anything(tmp_path, capsys):
    from dynaspec.cli import main

    assert main(["train-drafter", "--target", "tiny-llama", "--stage", "collect", "--work", str(tmp_path / "w"),
                 "--source", "raw", "--temperature", "0.7"]) == 2
    assert "--source generated" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_first_prompt_collects_the_prompts_after_it_and_a_folder_keeps_one_range(tmp_path, prompts):
    import json

    from dynaspec.training.shards import shard_metadata

    tgt = tiny_target("llama")
    whole = dc.collect(tgt, tmp_path / "all", prompts=4, shard_size=2, batch=2, new_tokens=3)
    later = dc.collect(tgt, tmp_path / "later", prompts=2, shard_size=2, batch=2, new_tokens=3, first_prompt=2)
    assert len(later) == 1
    # the same prompts and the same greedy continuations as the second shard of the whole range
    assert sorted(_tokens(later)[0]) == sorted(_tokens(whole[1:])[0])
    assert sorted(json.loads(shard_metadata(later[0])["ids"])) == ["id2", "id3"]
    assert shard_metadata(later[0])["first_prompt"] == "2"
    assert "prompts from #2 on" in describe_shards(later)["data"]
    with pytest.raises(ConfigError, match="from prompt 2 on"):
        dc.collect(tgt, tmp_path / "later", prompts=4, shard_size=2, batch=2, new_tokens=3)
    with pytest.raises(ConfigError, match="must be >= 0"):
        dc.collect(tgt, tmp_path / "neg", prompts=2, shard_size=2, new_tokens=3, first_prompt=-1)
