"""The train-drafter pipeline on a tiny target: resumable collection shards, training with
checkpoints, an atomic artifact that records its target and refuses others."""

from __future__ import annotations

import json

import pytest
import torch

from dynaspec.errors import ArtifactMismatchError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.targets import load_drafter
from dynaspec.training import collect as dc
from dynaspec.training import drafter as dt
from dynaspec.training.shards import shard_metadata

TEXTS = ["Hello there, how are you?", "Write a poem about the sea.", "def f(x): return x * 2",
         "Bonjour, comment allez-vous ?", "Explain gravity simply.", "List three colours."]


@pytest.fixture
def fake_prompts(monkeypatch):
    def prompt_batches(tokenizer, start, count, max_prompt_tokens, split="train", slice_name=None, fmt=None, turns="first"):
        return [(f"id{k}", tokenizer(TEXTS[k])["input_ids"][:max_prompt_tokens])
                for k in range(start, min(start + count, len(TEXTS)))]

    monkeypatch.setattr(dc, "_prompt_batches", prompt_batches)


def test_collect_is_resumable_and_complete(tmp_path, fake_prompts):
    target = tiny_target("llama")
    paths = dc.collect(target, tmp_path, prompts=6, shard_size=4, batch=3, new_tokens=10)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    shard = dt.load_shard(paths[0])
    offsets = shard["offsets"]
    assert offsets.numel() == 5 and int(offsets[-1]) == shard["tokens"].numel()
    assert shard["features"].shape == (shard["tokens"].numel(), target.hidden_size)
    assert shard["features"].dtype == torch.bfloat16
    # continuation = the target's own greedy text after the prompt
    first = shard["tokens"][: int(offsets[1])].tolist()
    plen = int(shard["prompt_lens"][0])
    expected = target.model.generate(torch.tensor([first[:plen]]), max_new_tokens=10, do_sample=False)
    assert first == expected[0].tolist()
    mtimes = [p.stat().st_mtime_ns for p in paths]
    paths[1].unlink()  # an interrupted run: the missing shard is made again, the other kept
    dc.collect(target, tmp_path, prompts=6, shard_size=4, batch=3, new_tokens=10)
    assert paths[0].stat().st_mtime_ns == mtimes[0] and paths[1].exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_train_resumes_and_writes_artifact(tmp_path, fake_prompts):
    target = tiny_target("llama")
    work, out = tmp_path / "work", tmp_path / "drafter"
    dc.collect(target, work, prompts=6, shard_size=3, batch=3, new_tokens=20)
    kwargs = dict(window=16, batch_positions=64, unroll=2, frequent=16, checkpoint_every=2)
    dt.train(target, work, out, epochs=1, **kwargs)
    first = json.loads((work / "ckpt-drafter" / "checkpoint.json").read_text())
    assert first["epoch"] == 1 and first["step"] > 0
    drafter = dt.train(target, work, out, epochs=2, **kwargs)  # resumes at epoch 1
    second = json.loads((work / "ckpt-drafter" / "checkpoint.json").read_text())
    assert second["epoch"] == 2 and second["step"] == 2 * first["step"]
    # a step budget: later epochs read the shard list again (here: a shard added meanwhile)
    dc.collect(target, work, prompts=6, shard_size=2, batch=2, new_tokens=5)  # shards 0-2 exist: no-op
    stepped = dt.train(target, work, tmp_path / "stepped", steps=5, **kwargs)
    assert stepped.meta["training"]["steps"] == 5
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["target"] == target.fingerprint() and meta["training"]["unroll"] == 2
    loaded = load_drafter(str(out), target)
    assert isinstance(loaded, Drafter) and loaded.cfg == drafter.cfg
    with pytest.raises(ArtifactMismatchError, match="another target"):
        load_drafter(str(out), tiny_target("gemma3"))


def test_resumed_training_records_the_shards_it_ended_with_and_all_its_time(tmp_path, fake_prompts, monkeypatch):
    from dynaspec.errors import ConfigError

    target = tiny_target("llama")
    work = tmp_path / "work"
    dc.collect(target, work, prompts=4, shard_size=2, batch=2, new_tokens=6)
    kwargs = dict(window=16, batch_positions=32, unroll=2, frequent=16, checkpoint_every=1)
    dt.train(target, work, tmp_path / "d", steps=2, **kwargs)
    earlier = json.loads((work / "ckpt-d" / "checkpoint.json").read_text())["seconds"]
    assert earlier > 0
    # a raw shard lands in the folder while the run is paused; the resumed run's later epochs use it
    monkeypatch.setattr(dc, "_raw_batches", lambda tok, start, count, max_tokens, split="train", slice_name=None, fmt=None, turns="first":
                        [("r", tok(TEXTS[3])["input_ids"], 2)] if start == 0 else [])
    raw = dc.collect(target, tmp_path / "raw", prompts=1, shard_size=1, source="raw", new_tokens=4,
                     slice_name="non-english")
    raw[0].rename(work / "shard-01000.safetensors")
    drafter = dt.train(target, work, tmp_path / "d", steps=40, **kwargs)
    training = drafter.meta["training"]
    assert training["shard_sources"] == {"generated": 2, "raw": 1} and training["shards_at_end"] == 3
    assert "1 shards of raw conversations" in training["data"]
    assert "1 of the raw shards hold only non-english conversations" in training["data"]
    assert training["train_seconds"] >= earlier + training["train_seconds_this_run"] - 0.1
    (one,) = training["shard_sets"]  # one folder, holding two kinds of shards (a folder from before the check)
    assert one["folder"] == "work" and one["shards"] == 3 and one["conversations"] == 5
    greedy = {"turns": "first", "sampling": "greedy"}
    assert one["kind"] == [{"split": "train", "slice": "all", "source": "generated", **greedy},
                           {"split": "train", "slice": "non-english", "source": "raw", **greedy}]
    recorded = [float(shard_metadata(p)["seconds"]) for p in dt.shard_paths(work)[:3]]
    assert one["new_tokens"] == [4, 6] and one["timed_shards"] == 3 and one["collect_seconds"] == round(sum(recorded), 1)
    assert one["positions"] == training["positions_at_end"] == dt.positions(dt.shard_paths(work)[:3])
    # a dev shard in the folder stops a resumed run instead of training on it
    dev = dc.collect(target, tmp_path / "dev", prompts=2, shard_size=2, batch=2, new_tokens=4, split="dev")
    dev[0].rename(work / "shard-02000.safetensors")
    with pytest.raises(ConfigError, match="train only on train shards"):
        dt.train(target, work, tmp_path / "d", steps=80, **kwargs)


def test_prompt_batches_filter_one_slice(monkeypatch):
    from dynaspec.training import data

    items = [{"id": f"p{k}", "text": f"text {k}", "slice": "code" if k % 3 == 0 else "english"} for k in range(12)]
    monkeypatch.setattr(data, "training_prompts", lambda: iter(items))
    tok = tiny_target("llama").tokenizer
    got = dc._prompt_batches(tok, 1, 2, 50, "train", "code")
    assert [i for i, _ in got] == ["p3", "p6"]  # the 2nd and 3rd code prompts
    assert [i for i, _ in dc._prompt_batches(tok, 0, 3, 50, "train")] == ["p0", "p1", "p2"]


def test_raw_collection_stores_the_targets_greedy_next_token(tmp_path, monkeypatch):
    from dynaspec.training.router import router_examples

    tgt = tiny_target("llama")

    def raw_batches(tokenizer, start, count, max_tokens, split="train", slice_name=None, fmt=None, turns="first"):
        return [(f"r{k}", tokenizer(TEXTS[k])["input_ids"][:max_tokens], 3)
                for k in range(start, min(start + count, len(TEXTS)))]

    monkeypatch.setattr(dc, "_raw_batches", raw_batches)
    paths = dc.collect(tgt, tmp_path / "raw", prompts=3, shard_size=2, source="raw", new_tokens=20,
                       max_prompt_tokens=10)
    assert len(paths) == 2
    shard = dt.load_shard(paths[0])
    tokens, offs, teacher = shard["tokens"].long(), shard["offsets"].tolist(), shard["teacher"].long()
    assert teacher.shape == tokens.shape and shard["prompt_lens"].tolist() == [3, 3]
    for a, b in zip(offs[:-1], offs[1:]):
        with torch.inference_mode():
            greedy = tgt.model(input_ids=tokens[a:b][None]).logits[0].argmax(-1)
        assert torch.equal(teacher[a:b], greedy)  # the target's choice, not the text's next token
    assert not torch.equal(teacher[offs[0]:offs[1] - 1], tokens[offs[0] + 1:offs[1]])
    assignment = torch.arange(tgt.vocab_size) % 5
    emb, prev, labels = router_examples(shard, tgt.embed, assignment, None)
    a, b = offs[0], offs[1]
    assert torch.equal(labels[: b - a - 3], assignment[teacher[a + 2:b - 1]])
    assert emb.shape == prev.shape and len(labels) == emb.shape[0]


def test_describe_shards_counts_sources_and_refuses_dev(tmp_path, fake_prompts, monkeypatch):
    from dynaspec.errors import ConfigError

    tgt = tiny_target("llama")
    gen = dc.collect(tgt, tmp_path / "w", prompts=2, shard_size=2, batch=2, new_tokens=4)
    monkeypatch.setattr(dc, "_raw_batches", lambda tok, start, count, max_tokens, split="train", slice_name=None, fmt=None, turns="first":
                        [("r", tok(TEXTS[0])["input_ids"], 2)] if start == 0 else [])
    raw = dc.collect(tgt, tmp_path / "r", prompts=1, shard_size=1, source="raw", new_tokens=4)
    described = dt.describe_shards(gen + raw)
    assert described["sources"] == {"generated": 1, "raw": 1} and described["shards"] == 2
    assert "1 shards of raw conversations" in described["data"]
    dev = dc.collect(tgt, tmp_path / "d", prompts=2, shard_size=2, batch=2, new_tokens=4, split="dev")
    with pytest.raises(ConfigError, match="train only on train shards"):
        dt.describe_shards(gen + dev)


def test_train_drafter_cli_records_its_data_and_refuses_dev_shards(tmp_path, fake_prompts):
    from dynaspec.cli import main

    tgt = tiny_target("llama")
    dc.collect(tgt, tmp_path / "w", prompts=4, shard_size=2, batch=2, new_tokens=6)
    args = ["train-drafter", "--target", "tiny-llama", "--stage", "train", "--work", str(tmp_path / "w"),
            "--steps", "2", "--batch-positions", "32", "--window", "16"]
    assert main([*args, "--out", str(tmp_path / "drafter")]) == 0
    config = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    assert config["training"]["shard_sources"] == {"generated": 2}
    assert "2 shards of first human turns" in config["training"]["data"]
    assert config["training"]["work"] == ["w"]  # folder names, no machine paths
    dc.collect(tgt, tmp_path / "d", prompts=2, shard_size=2, batch=2, new_tokens=4, split="dev")
    assert main([*args[:6], str(tmp_path / "d"), *args[7:], "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    # several folders: every shard of each is read, the checkpoints live in the first
    dc.collect(tgt, tmp_path / "more", prompts=2, shard_size=2, batch=2, new_tokens=6)
    both = [*args[:6], str(tmp_path / "w"), str(tmp_path / "more"), *args[7:], "--out", str(tmp_path / "two")]
    assert main(both) == 0
    training = json.loads((tmp_path / "two" / "drafter.json").read_text())["training"]
    assert training["shards_at_end"] == 3 and training["work"] == ["w", "more"]
    sets = training["shard_sets"]  # one record per folder, in the order given
    assert [(one["folder"], one["shards"], one["conversations"], one["new_tokens"]) for one in sets] == \
        [("w", 2, 4, 6), ("more", 1, 2, 6)]
    assert all(one["kind"] == {"split": "train", "slice": "all", "source": "generated", "turns": "first",
                               "sampling": "greedy"}
               for one in sets)
    assert sum(one["positions"] for one in sets) == training["positions_at_end"] > 0
    state = json.loads((tmp_path / "w" / "ckpt-two" / "checkpoint.json").read_text())
    assert "../more/shard-00000.safetensors" in state["shards"]
    assert main([*args[:4], "collect", "--work", str(tmp_path / "w"), str(tmp_path / "more"), "--out",
                 str(tmp_path / "y")]) == 2  # collection writes one folder


def test_collection_writes_the_targets_own_prompt_format(tmp_path, monkeypatch):
    """The shards of a target with its own prompt format (a chat template, say) hold prompts in
    that format, not the embedded Gemma's."""
    from dynaspec.training import data

    conv = {"id": "c1", "conversations": [{"from": "human", "value": "Hi there"},
                                          {"from": "gpt", "value": "Hello"}]}
    monkeypatch.setattr(data, "load_split", lambda split: [conv])
    target = tiny_target("llama")
    target.prompt_format = "Q> {text} <A"
    seen = []
    real = dc._raw_batches

    def spy(*args, **kwargs):
        items = real(*args, **kwargs)
        seen.extend(items)
        return items

    monkeypatch.setattr(dc, "_raw_batches", spy)
    shards = dc.collect(target, tmp_path / "w", prompts=1, shard_size=1, source="raw", new_tokens=8)
    (_, ids, prompt_len), = seen
    assert target.tokenizer.decode(ids[:prompt_len], skip_special_tokens=True) == "Q> Hi there <A"
    shard = dt.load_shard(shards[0])
    assert shard["tokens"].tolist() == ids and shard["prompt_lens"].tolist() == [prompt_len]


def test_training_can_start_from_a_drafter_and_keeps_its_record(tmp_path, fake_prompts):
    from dynaspec.cli import main
    from dynaspec.errors import ConfigError

    target = tiny_target("llama")
    work = tmp_path / "w"
    dc.collect(target, work, prompts=4, shard_size=2, batch=2, new_tokens=6)
    kwargs = dict(window=16, batch_positions=32, unroll=2, frequent=16)
    first = dt.train(target, work, tmp_path / "a", steps=2, feature_layers=[0], **kwargs)
    start = load_drafter(str(tmp_path / "a"), target)
    still = dt.train(target, work, tmp_path / "b", steps=2, lr=0.0, init=start, **kwargs)  # lr 0: nothing moves
    assert still.cfg == first.cfg and still.cfg.feature_layers == first.cfg.feature_layers
    for name, value in start.state_dict().items():
        assert torch.equal(still.state_dict()[name], value.float()), name
    fresh = dt.train(target, work, tmp_path / "c", steps=2, lr=0.0, feature_layers=[0], **kwargs)
    assert any(not torch.equal(fresh.state_dict()[k], v.float()) for k, v in start.state_dict().items())
    with pytest.raises(ConfigError, match="feature layers .1. differ from the starting drafter's .0."):
        dt.train(target, work, tmp_path / "d", steps=2, init=start, feature_layers=[1], **kwargs)
    assert start.cfg.intermediate_size > 48
    with pytest.raises(ConfigError, match="width 48 is narrower than the starting drafter's"):
        dt.train(target, work, tmp_path / "d", steps=2, init=start, intermediate_size=48, **kwargs)
    wide = 2 * start.cfg.intermediate_size  # wider: widened, the same function while nothing moves
    widened = dt.train(target, work, tmp_path / "w2", steps=2, lr=0.0, init=start, intermediate_size=wide, **kwargs)
    assert widened.cfg.intermediate_size == wide
    x = torch.randn(1, 5, start.cfg.hidden_size)
    feats = torch.randn(1, 5, start.cfg.hidden_size * len(start.cfg.feature_layers))
    pos = torch.arange(5)[None]
    with torch.no_grad():
        torch.testing.assert_close(widened(x, widened.project(feats), pos), start.float()(x, start.float().project(feats), pos))

    args = ["train-drafter", "--target", "tiny-llama", "--stage", "train", "--work", str(work), "--steps", "2",
            "--batch-positions", "32", "--window", "16"]
    assert main([*args, "--out", str(tmp_path / "e"), "--init", str(tmp_path / "a")]) == 0
    training = json.loads((tmp_path / "e" / "drafter.json").read_text())["training"]
    assert training["init"]["drafter"] == "a" and training["init"]["training"]["steps"] == 2
    assert training["init"]["training"]["feature_layers"] == list(first.cfg.feature_layers)
    assert main([*args, "--out", str(tmp_path / "x"), "--init", "nowhere"]) == 2  # no such drafter
    assert not (tmp_path / "x").exists()


def test_the_loss_reads_the_answer_positions_only_by_default(tmp_path, fake_prompts):
    from dynaspec.errors import ConfigError
    from dynaspec.training.shards import shard_paths

    target = tiny_target("llama")
    work = tmp_path / "w"
    dc.collect(target, work, prompts=4, shard_size=4, batch=4, new_tokens=6)
    shard = dt.load_shard(shard_paths(work)[0])
    offs, plens = shard["offsets"].tolist(), shard["prompt_lens"].tolist()
    answer, every = dt.loss_mask(shard, "answer"), dt.loss_mask(shard, "all")
    for a, b, plen in zip(offs[:-1], offs[1:], plens):
        # the prediction of feature j drafts token j + 1: the answer's are those from the prompt's last
        assert answer[a:b].tolist() == [False] * (plen - 1) + [True] * (b - a - plen + 1)
        assert every[a:b].tolist() == [False] + [True] * (b - a - 1)  # every target of the old loss
    # windows wholly inside a prompt are dropped, and none crosses a sequence
    wins = dt._windows(shard, 2, answer)
    assert wins and all(bool(answer[s + 1:e].any()) for s, e in wins)
    assert len(wins) < len(dt._windows(shard, 2)) == len(dt._windows(shard, 2, every))

    # the loss's gradient reaches the drafter's last-step predictions (which feed nothing else) at
    # the answer's positions only
    class Recording(dt._Unrolled):
        def forward(self, *args):
            self.preds = super().forward(*args)
            for pred in self.preds:
                pred.retain_grad()
            return self.preds

    model = Recording(Drafter(dt.DrafterConfig.like_target(target.model)).float(), 2)
    batch = dt._windows(shard, 64)
    assert len(batch) == len(offs) - 1  # one window per sequence, starting at its first token
    loss, _ = dt._step_loss(model, target.lm_head_weight.detach(), torch.arange(16), shard, batch,
                            target.embed, 0.0, torch.Generator(), mask=answer)
    loss.backward()
    for row, (a, b) in enumerate(batch):
        reads = model.preds[-1].grad[row, : b - a - 1].abs().sum(-1) > 0  # row t predicts feature a + 1 + t
        assert reads.tolist() == answer[a + 1:b].tolist()
    with pytest.raises(ConfigError, match="loss_on"):
        dt.train(target, work, tmp_path / "x", steps=1, loss_on="prompt")


def _first_step_accuracy(target, drafter, work) -> float:
    """How often the drafter's first step ranks the target's own next token first, over the first
    shard's answer positions."""
    import random

    shard = dt.load_shard(dt.shard_paths(work)[0])
    mask = dt.loss_mask(shard)
    batch = [w for b in dt._batches(shard, 16, 10_000, random.Random(0), mask) for w in b]
    freq = dt._frequent_tokens(dt.shard_paths(work), 16)
    with torch.no_grad():
        _, stats = dt._step_loss(dt._Unrolled(drafter.float(), 1), target.lm_head_weight, freq, shard, batch,
                                 target.embed, 0.0, torch.Generator(), mask=mask)
    return stats["acc0"]


def test_training_with_bfloat16_products_learns_as_float32_does(tmp_path, fake_prompts):
    from dynaspec.errors import ConfigError
    from dynaspec.runtime.drafter import DrafterConfig

    target = tiny_target("llama")
    work = tmp_path / "work"
    dc.collect(target, work, prompts=6, shard_size=6, batch=3, new_tokens=20)
    kwargs = dict(window=16, batch_positions=64, unroll=2, frequent=16, steps=40, lr=3e-3)
    torch.manual_seed(0)
    untrained = _first_step_accuracy(target, Drafter(DrafterConfig.like_target(target.model)), work)
    acc = {}
    for precision in ("float32", "bfloat16"):
        drafter = dt.train(target, work, tmp_path / precision, precision=precision, **kwargs)
        assert drafter.meta["training"]["precision"] == precision
        acc[precision] = _first_step_accuracy(target, drafter, work)
    assert acc["float32"] > untrained + 0.3 and acc["bfloat16"] > untrained + 0.3
    assert abs(acc["bfloat16"] - acc["float32"]) < 0.05
    assert dt.training_precision("float32") == "float32"
    with pytest.raises(ConfigError, match="precision 'half'"):
        dt.training_precision("half")


def test_training_bounds_the_heap_as_the_environment_variable_would(monkeypatch):
    """Shard after shard of tens of megabytes: glibc is told to serve such blocks by mmap (and give
    them back), as MALLOC_MMAP_THRESHOLD_=1048576 does; nothing is changed where that is set."""
    import ctypes
    import sys

    from dynaspec.training import shards

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param.value, value.value))
            return 1

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    assert shards.bound_heap_growth() is True
    assert calls == [(-3, 1 << 20)]  # glibc's M_MMAP_THRESHOLD, 1 MiB
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert shards.bound_heap_growth() is False and len(calls) == 1
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert shards.bound_heap_growth() is False and len(calls) == 1


def test_the_heap_bound_is_set_in_this_process_where_glibc_runs_it():
    import platform

    from dynaspec.training import shards

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc on Linux only")
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        pytest.skip("the environment sets it")
    assert shards.bound_heap_growth() is True
