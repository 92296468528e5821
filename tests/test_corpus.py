"""The ``corpus`` drafter: its table of the target's own answers (counting, proposing, files, the
target it was built for), ``dynaspec build-corpus``, and decoding with it: greedy output equal to
the target's own, token for token, and sampling that keeps the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import builtin_registry, reference_greedy, target, trained_drafter
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.corpus import CorpusTable
from dynaspec.runtime.engine import Engine


# -- the table ---------------------------------------------------------------------------------------
def test_count_keeps_the_likeliest_next_token_of_answer_ngrams_only():
    answers = [([9, 9, 1, 2], [3, 4, 5]), ([7, 1, 2], [3, 4, 6]), ([1, 2], [3, 8, 8])]
    table = CorpusTable.count(answers, sizes=(2, 3), min_count=1)
    # "1 2" ends every prompt: its next token is an answer's first one, 3 each time
    assert table.tables[2][(1, 2)] == (3, 3, 3)
    assert table.tables[2][(3, 4)] == (5, 1, 2)  # 5 and 6 once each: the first seen is kept
    assert table.tables[3][(1, 2, 3)] == (4, 2, 3)  # 4 twice, 8 once
    # n-grams inside a prompt, whose next token is the prompt's own, are not counted
    assert (9, 9) not in table.tables[2] and (9, 1) not in table.tables[2] and (7, 1) not in table.tables[2]
    kept = CorpusTable.count(answers, sizes=(2, 3), min_count=2)
    assert (3, 8) not in kept.tables[2] and kept.tables[2][(3, 4)] == (5, 1, 2)


def test_propose_follows_the_longest_known_ngram_and_stops_where_it_is_unsure():
    table = CorpusTable({3: {(1, 2, 3): (4, 9, 10), (2, 3, 4): (5, 3, 6)},
                         2: {(1, 2): (3, 2, 2), (3, 4): (7, 5, 5), (4, 5): (6, 4, 4), (5, 6): (1, 1, 1)}})
    # "1 2 3" -> 4 (9 of 10); then "2 3 4" is known but 5 followed only half the time: at
    # min_share 0.5 it passes, at 0.6 the chain stops there (the shorter "3 4" -> 7 is not asked)
    assert table.propose([0, 1, 2, 3], 5, min_count=2, min_share=0.5) == [4, 5, 6]
    assert table.propose([0, 1, 2, 3], 5, min_count=2, min_share=0.6) == [4]
    assert table.propose([0, 1, 2, 3], 2, min_count=2, min_share=0.5) == [4, 5]  # the limit
    assert table.propose([8, 3, 4], 5, min_count=2, min_share=0.5) == [7]  # "8 3 4" unknown: "3 4"
    assert table.propose([4, 5], 5, min_count=5, min_share=0.1) == []  # 6 followed only 4 times
    assert table.propose([9], 5, min_count=1, min_share=0.1) == []  # too short for any n-gram


def test_table_files_round_trip_and_refuse_another_target(tmp_path):
    answers = [([1, 2], [3, 4, 5, 3, 4, 5]), ([0, 1], [2, 3, 4])]
    table = CorpusTable.count(answers, sizes=(2, 3, 4), min_count=1)
    fingerprint = target("llama").fingerprint()
    path = table.save(tmp_path / "c", {"target": fingerprint, "command": "test"})
    loaded, info = CorpusTable.load(tmp_path / "c", fingerprint)
    assert loaded.tables == table.tables and loaded.sizes == (4, 3, 2)
    assert info["entries"] == len(table) and info["command"] == "test"
    assert path.name == "corpus.safetensors"
    with pytest.raises(ArtifactMismatchError, match="built for another target"):
        CorpusTable.load(tmp_path / "c", target("gemma3").fingerprint())
    with pytest.raises(ConfigError, match="no corpus at"):
        CorpusTable.load(tmp_path / "nothing", fingerprint)
    with pytest.raises(ConfigError, match="sizes must be integers >= 1"):
        CorpusTable.count(answers, sizes=(0, 2))


# -- decoding ----------------------------------------------------------------------------------------
def _prompts(seed: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 99, (6,), generator=gen).tolist() for _ in range(n)]


def _corpus_of_own_answers(kind: str, folder, prompts) -> str:
    """A corpus of the tiny target's own greedy answers to ``prompts``, saved in ``folder``."""
    answers = [(p, reference_greedy(kind, p, 40)) for p in prompts]
    CorpusTable.count(answers, min_count=1).save(folder, {"target": target(kind).fingerprint()})
    return str(folder)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_greedy_output_is_the_targets_with_the_corpus_drafter(kind, tmp_path):
    prompts = _prompts(11, 6)
    corpus = _corpus_of_own_answers(kind, tmp_path / "corpus", prompts[:4])
    drafter = {"name": "composite", "drafters": [
        "ngram", {"name": "corpus", "artifact": corpus, "min_count": 1}, "in-memory"]}
    engine = Engine(stack_from_mapping({"name": "t", "target": f"tiny-{kind}", "drafter": drafter,
                                        "draft": {"mode": "chain", "depth": 5}}),
                    target(kind), trained_drafter(kind), registry=builtin_registry())
    assert engine.exactness == "guaranteed" and engine.source.chains_only
    drafted = accepted = 0
    for prompt in prompts:  # four whose answers the corpus holds, two it never saw
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == reference_greedy(kind, prompt, 40), prompt
        drafted += result.stats.draft_sources[1]
        accepted += sum(result.stats.accepted_at)
    assert drafted > 0 and accepted > 0  # the corpus drafted cycles, and their tokens were right


def test_sampling_with_the_corpus_drafter_keeps_target_distribution(tmp_path):
    from test_drafters import sample_second_tokens, sampling_target
    from test_sampling import chi2_pvalue

    tgt = sampling_target()
    prompt = [0, 3, 5, 7, 0, 3]
    # a corpus that always continues "0 3" with "5 7 0 3": proposals at every cycle
    CorpusTable.count([([0, 3], [5, 7, 0, 3, 5, 7, 0, 3])], min_count=1).save(
        tmp_path / "c", {"target": tgt.fingerprint()})
    drafter = {"name": "composite", "drafters": [{"name": "corpus", "artifact": str(tmp_path / "c"),
                                                  "min_count": 1}, "d"]}
    samples = 2500
    counts, p2, stats = sample_second_tokens(tgt, drafter, prompt, samples)
    drafted = sum(s.draft_sources[0] for s in stats)
    accepted = sum(sum(s.accepted_at) for s in stats)
    assert chi2_pvalue(counts, p2) > 1e-3
    assert 0.5 * np.abs(counts / samples - p2).sum() < 0.06
    assert drafted > 0 and accepted > 0  # the corpus drafted, and some of it was accepted


# -- configuration and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("params,message", [
    ({}, "no corpus 'tiny-llama'.*ships none"),
    ({"artifact": "/no/such/folder"}, "no corpus '/no/such/folder'"),
    ({"artifact": "x", "min_share": 1.5}, "min_share = 1.5 is invalid"),
    ({"artifact": "x", "min_count": 0}, "min_count = 0 is invalid"),
])
def test_bad_corpus_drafters_are_refused_with_a_clear_message(params, message):
    with pytest.raises(ConfigError, match=message):
        Engine(stack_from_mapping({"name": "s", "target": "tiny-llama", "draft": {"mode": "chain"},
                                   "drafter": {"name": "corpus", **params}}),
               target("llama"), None, registry=builtin_registry())


def test_a_corpus_for_another_target_is_refused(tmp_path):
    CorpusTable.count([([1], [2, 3])], min_count=1).save(tmp_path / "c", {"target": target("gemma3").fingerprint()})
    with pytest.raises(ArtifactMismatchError, match="built for another target"):
        Engine(stack_from_mapping({"name": "s", "target": "tiny-llama", "draft": {"mode": "chain"},
                                   "drafter": {"name": "corpus", "artifact": str(tmp_path / "c")}}),
               target("llama"), None, registry=builtin_registry())


def test_build_corpus_counts_greedy_train_answers_and_refuses_dev_shards(tmp_path):
    from dynaspec.training.collect import collect
    from dynaspec.training.shards import shard_answers, shard_paths
    from dynaspec.training.vocabulary import build_corpus

    tgt = target("llama")
    work = tmp_path / "work"
    collect(tgt, work, prompts=4, shard_size=2, new_tokens=16, source="generated")
    path, counts = build_corpus(tgt, [work], tmp_path / "corpus", command="test", progress=False)
    table, info = CorpusTable.load(path, tgt.fingerprint())
    assert counts == {"entries": len(table), "shards": 2} and len(table) > 0
    assert info["min_count"] == 2 and "2 collected shards" in info["corpus"]
    answers = list(shard_answers(shard_paths(work)))
    assert len(answers) == 4 and all(len(a) > 0 for _, a in answers)
    assert table.tables == CorpusTable.count(answers, min_count=2).tables
    dev = tmp_path / "dev"
    collect(tgt, dev, prompts=2, shard_size=2, new_tokens=8, source="generated", split="dev")
    with pytest.raises(ConfigError, match="holds dev prompts"):
        build_corpus(tgt, [dev], tmp_path / "c2", progress=False)
    with pytest.raises(ConfigError, match="no collected shards"):
        build_corpus(tgt, [tmp_path / "empty"], tmp_path / "c3", progress=False)


def test_build_corpus_command(tmp_path, capsys):
    from dynaspec.cli import main
    from dynaspec.training.collect import collect

    collect(target("llama"), tmp_path / "work", prompts=2, shard_size=2, new_tokens=16, source="generated")
    assert main(["build-corpus", "--target", "tiny-llama", "--work", str(tmp_path / "work"),
                 "--out", str(tmp_path / "c"), "--min-count", "1"]) == 0
    assert "n-grams from 1 shards" in capsys.readouterr().err
    _, info = CorpusTable.load(tmp_path / "c", target("llama").fingerprint())
    assert info["min_count"] == 1 and info["command"].startswith("dynaspec")  # the command line, as run
