"""Collection from later human turns (``train-drafter --stage collect --turns later``): every human
turn after the first, standing alone as a prompt, from train conversations outside the window that
settings are chosen on; shards record the kind, and a folder refuses shards of another kind."""

from __future__ import annotations

import itertools
import json

import pytest
from safetensors import safe_open

from dynaspec.errors import ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.training import collect as dc
from dynaspec.training import data
from dynaspec.training.shards import describe_shards, load_shard


def _ids(split: str, n: int) -> list[str]:
    """``n`` conversation ids that land in ``split``."""
    return list(itertools.islice((f"c{k}" for k in itertools.count() if data.split_of(f"c{k}") == split), n))


def _conv(conv_id: str, *turns: tuple[str, str]) -> dict:
    msgs = []
    for role, text in turns:
        msgs.append({"from": role, "value": text})
    return {"id": conv_id, "conversations": msgs}


@pytest.fixture
def conversations(monkeypatch):
    a, b, c = _ids("train", 3)
    (d,) = _ids("dev", 1)
    convs = (
        _conv(a, ("human", "Hello there"), ("gpt", "Hi."), ("human", "Wie geht es dir und der Familie heute?"),
              ("gpt", "Gut, danke."), ("human", "  "), ("gpt", "..."), ("human", "Write a poem"), ("gpt", "Roses.")),
        _conv(d, ("human", "dev first"), ("gpt", "x"), ("human", "dev second"), ("gpt", "y")),
        _conv(b, ("human", "Second conversation"), ("gpt", "Sure."), ("human", "And a follow-up?")),
        _conv(c, ("human", "Third"), ("gpt", "ok"), ("human", "Past the selection window")),
    )
    monkeypatch.setattr(data, "_conversations", lambda: convs)
    monkeypatch.setattr(data, "SELECTION_OFFSET", 2)
    return a, b, c, d


def test_human_turns_pair_each_turn_with_the_reply_that_follows():
    conv = _conv("x", ("gpt", "opening"), ("human", "a"), ("gpt", "ra"), ("human", "b"), ("human", "c"),
                 ("gpt", "rc"), ("gpt", "extra"))
    assert data.human_turns(conv) == [("a", "ra"), ("b", None), ("c", "rc")]
    assert data.human_turns({"id": "y", "conversations": []}) == []


def test_later_turn_prompts_skip_first_turns_dev_and_the_selection_window(conversations):
    a, b, c, _ = conversations
    items = list(data.later_turn_prompts())
    assert [i["id"] for i in items] == [f"{a}#2", f"{a}#4", f"{b}#2"]  # blank turn 3 skipped; c is past the window
    assert [i["text"] for i in items] == ["Wie geht es dir und der Familie heute?", "Write a poem", "And a follow-up?"]
    assert [i["answer"] for i in items] == ["Gut, danke.", "Roses.", None]
    assert [i["slice"] for i in items] == ["non-english", "english", "english"]
    assert [i["text"] for i in data.later_turn_prompts(max_chars=5)][:2] == ["Wie g", "Write"]


def test_collect_later_turns_generated_and_raw(tmp_path, conversations):
    a, b, _, _ = conversations
    tgt = tiny_target("llama")
    gen = dc.collect(tgt, tmp_path / "gen", prompts=3, shard_size=2, batch=2, new_tokens=4, turns="later")
    assert len(gen) == 2
    with safe_open(str(gen[0]), framework="pt") as fh:
        meta = fh.metadata()
    ids = json.loads(meta["ids"])
    assert meta["turns"] == "later" and sorted(ids) == [f"{a}#2", f"{a}#4"]
    shard = load_shard(gen[0])
    lens = shard["prompt_lens"].tolist()
    assert lens == sorted(lens)  # a shard's prompts are generated for in order of length
    row = ids.index(f"{a}#2")
    start, plen = int(shard["offsets"][row]), lens[row]
    prompt = tgt.tokenizer(tgt.format_prompt("Wie geht es dir und der Familie heute?"))["input_ids"]
    assert shard["tokens"][start:start + plen].tolist() == prompt
    assert "human turns (2 of them later turns standing alone)" in describe_shards(gen)["data"]

    raw = dc.collect(tgt, tmp_path / "raw", prompts=5, shard_size=5, source="raw", new_tokens=8, turns="later",
                     slice_name="non-english")
    with safe_open(str(raw[0]), framework="pt") as fh:
        assert fh.metadata()["ids"] == f'["{a}#2"]'  # the only non-English later turn with an answer
    text = tgt.format_prompt("Wie geht es dir und der Familie heute?") + " Gut, danke."
    assert load_shard(raw[0])["tokens"].tolist() == tgt.tokenizer(text)["input_ids"]
    assert "a human turn + its answer; 1 of them later turns standing alone" in describe_shards(raw)["data"]
    first = dc.collect(tgt, tmp_path / "first", prompts=1, shard_size=1, batch=1, new_tokens=2)
    assert "1 shards of first human turns" in describe_shards(first)["data"]


def test_a_folder_refuses_shards_of_another_kind(tmp_path, conversations):
    tgt = tiny_target("llama")
    dc.collect(tgt, tmp_path / "w", prompts=2, shard_size=2, batch=2, new_tokens=2, turns="later")
    with pytest.raises(ConfigError, match="turns=later .asked: first."):
        dc.collect(tgt, tmp_path / "w", prompts=4, shard_size=2, batch=2, new_tokens=2)
    with pytest.raises(ConfigError, match="source=generated .asked: raw."):
        dc.collect(tgt, tmp_path / "w", prompts=4, shard_size=2, source="raw", turns="later")
    with pytest.raises(ConfigError, match="train split only"):
        dc.collect(tgt, tmp_path / "dev", prompts=2, shard_size=2, split="dev", turns="later")
    with pytest.raises(ConfigError, match="'first' or 'later'"):
        dc.collect(tgt, tmp_path / "bad", prompts=2, shard_size=2, turns="all")


def test_cli_refuses_later_turns_on_dev_before_loading_anything(tmp_path, capsys):
    from dynaspec.cli import main

    assert main(["train-drafter", "--target", "tiny-llama", "--stage", "collect", "--work", str(tmp_path / "w"),
                 "--turns", "later", "--split", "dev"]) == 2
    assert "train split only" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_shard_kind_reads_the_metadata_and_defaults_older_shards(tmp_path, conversations):
    import torch
    from safetensors.torch import save_file

    from dynaspec.training.shards import shard_kind

    tgt = tiny_target("llama")
    (later,) = dc.collect(tgt, tmp_path / "w", prompts=2, shard_size=2, batch=2, new_tokens=2, turns="later",
                          source="raw")
    assert shard_kind(later) == {"split": "train", "slice": "all", "source": "raw", "turns": "later", "sampling": "greedy"}
    old = tmp_path / "old" / "shard-00000.safetensors"  # written before shards recorded their kind
    old.parent.mkdir()
    save_file({"tokens": torch.zeros(3, dtype=torch.long)}, str(old), metadata={"ids": "[]"})
    assert shard_kind(old) == {"split": "train", "slice": "all", "source": "generated", "turns": "first",
                              "sampling": "greedy"}
    with pytest.raises(ConfigError, match="turns=first .asked: later."):  # the folder check reads the same defaults
        dc.collect(tgt, old.parent, prompts=2, shard_size=2, batch=2, new_tokens=2, turns="later")
