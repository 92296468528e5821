"""``dynaspec prepare`` end to end on a tiny target: every stage, the manifest, resuming after an
interruption, redoing one stage, a given drafter, a moved folder, and the README's commands."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from conftest import trained_drafter
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.engine import Engine
from dynaspec.shortlisters.frequency import load_frequency
from dynaspec.training import prepare as prep
from dynaspec.training.prepare import STAGES, PrepareBudget, prepare

# generated continuations: the tiny target's own text, which a drafter learns in seconds
BUDGET = PrepareBudget(prompts=16, source="generated", shard_size=4, new_tokens=32, steps=300,
                       batch_positions=256, router_width=32, drafter_width=48)


def _plain_and_spec(stack: Path, prompt: str = "Hello there") -> tuple:
    spec = Engine.from_stack(str(stack))
    plain = Engine.from_stack(str(stack), overrides={"drafter": "none"})
    prompt = spec.target.format_prompt(prompt)  # the format the drafter was trained in
    return spec.generate(prompt, max_new_tokens=24), plain.generate(prompt, max_new_tokens=24)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepare") / "tiny"
    manifest = prepare("tiny-llama", out, budget=BUDGET, command="test")
    return out, manifest


def test_prepare_builds_every_stage_and_a_working_stack(prepared):
    out, manifest = prepared
    assert sorted(manifest["stages"]) == sorted(STAGES)
    for name, stage in manifest["stages"].items():
        assert stage["seconds"] >= 0 and stage["command"] == "test" and stage["finished"], name
    assert manifest["budget"]["clusters"] == 8  # vocabulary 128 / 16
    assert set(manifest["stages"]["router"]["sha256"]) == {"router"}
    assert "shards of first human turns" in manifest["stages"]["collect"]["data"]
    collect = manifest["stages"]["collect"]  # each shard records its collection time
    assert collect["timed_shards"] == collect["shards"] == 4
    assert 0 < collect["collect_seconds"] <= collect["seconds"] + 0.05  # both rounded to 0.1 s
    assert json.loads((out / prep.MANIFEST).read_text()) == manifest
    spec, plain = _plain_and_spec(out / "stack.toml")
    assert spec.token_ids == plain.token_ids  # exact
    assert spec.stats.mean_accepted_length > 1.2  # and the drafter it trained drafts
    assert spec.stats.mean_shortlist_size <= 128
    assert json.loads((out / "drafter" / "drafter.json").read_text())["architecture"]["intermediate_size"] == 48


def test_rerun_skips_finished_stages_and_redo_runs_one(prepared, capsys):
    out, manifest = prepared
    again = prepare("tiny-llama", out, budget=BUDGET, command="test")
    assert again["stages"] == manifest["stages"]
    assert capsys.readouterr().err.count("done earlier") == len(STAGES)
    redone = prepare("tiny-llama", out, budget=BUDGET, redo=("clusters",), only=("clusters",), command="redo")
    assert redone["stages"]["clusters"]["command"] == "redo"
    assert redone["stages"]["router"] == manifest["stages"]["router"]


def test_two_processes_on_one_folder_keep_each_others_records(prepared, tmp_path, monkeypatch):
    """A stage records itself into the manifest as it is on disk when the stage ends, not into the
    copy its process read at its start: a collection running in the background and a stage run
    beside it both keep their records."""
    from dynaspec.training import vocabulary

    out = tmp_path / "tiny"
    shutil.copytree(prepared[0], out)
    real = vocabulary.build_frequency_list

    def beside(*args, **kwargs):  # another prepare process finishes a stage meanwhile
        other = json.loads((out / prep.MANIFEST).read_text())
        other["stages"]["collect"]["command"] = "the other process"
        (out / prep.MANIFEST).write_text(json.dumps(other))
        return real(*args, **kwargs)

    monkeypatch.setattr(vocabulary, "build_frequency_list", beside)
    manifest = prepare("tiny-llama", out, budget=BUDGET, redo=("frequency",), only=("frequency",), command="mine")
    on_disk = json.loads((out / prep.MANIFEST).read_text())
    assert on_disk == manifest
    assert on_disk["stages"]["collect"]["command"] == "the other process"
    assert on_disk["stages"]["frequency"]["command"] == "mine"
    assert on_disk["stages"]["router"] == prepared[1]["stages"]["router"]


def test_an_interrupted_prepare_resumes_where_it_stopped(tmp_path, monkeypatch):
    out = tmp_path / "tiny"
    import dynaspec.training.router as router_mod

    real = router_mod.build_router

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(router_mod, "build_router", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare("tiny-llama", out, budget=BUDGET, command="first")
    done = json.loads((out / prep.MANIFEST).read_text())["stages"]
    assert sorted(done) == sorted(["collect", "drafter", "frequency", "corpus", "clusters"])
    monkeypatch.setattr(router_mod, "build_router", real)
    manifest = prepare("tiny-llama", out, budget=BUDGET, command="second")
    assert [manifest["stages"][s]["command"] for s in STAGES] == ["first"] * 5 + ["second"] * 2


def test_refuses_another_target_and_bad_budgets(prepared, tmp_path):
    out, _ = prepared
    with pytest.raises(ConfigError, match="was prepared for target 'tiny-llama', not 'tiny-gemma3'"):
        prepare("tiny-gemma3", out, budget=BUDGET)
    with pytest.raises(ConfigError, match="exceeds the target's vocabulary"):
        prepare("tiny-llama", tmp_path / "x", budget=PrepareBudget(clusters=4096))
    assert not (tmp_path / "x").exists()  # a refused run leaves nothing behind
    with pytest.raises(ConfigError, match="unknown stage 'train'"):
        prepare("tiny-llama", tmp_path / "y", only=("train",))


def test_a_given_drafter_is_used_and_checked(prepared, tmp_path):
    out, _ = prepared
    trained_drafter("llama").save(tmp_path / "mine")
    manifest = prepare("tiny-llama", tmp_path / "p", budget=BUDGET, drafter=str(tmp_path / "mine"))
    assert manifest["stages"]["drafter"]["given"] is True
    assert not (tmp_path / "p" / "drafter").exists()
    assert str(tmp_path / "mine") in (tmp_path / "p" / "stack.toml").read_text()
    with pytest.raises(ArtifactMismatchError):
        prepare("tiny-gemma3", tmp_path / "q", budget=BUDGET, drafter=str(tmp_path / "mine"))


def test_the_prepared_folder_can_be_moved(prepared, tmp_path):
    out, _ = prepared
    moved = tmp_path / "elsewhere"
    shutil.copytree(out, moved)
    spec, plain = _plain_and_spec(moved / "stack.toml")
    assert spec.token_ids == plain.token_ids


def test_readme_use_your_own_model_commands(tmp_path):
    """The README's commands, run as written on a tiny Hugging Face model folder."""
    from dynaspec.plugins.tiny import tiny_target

    tiny = tiny_target("llama")
    tiny.model.save_pretrained(tmp_path / "model")
    tiny.tokenizer.save_pretrained(tmp_path / "model")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Use your own model", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("dynaspec ")]
    assert [c.split()[1] for c in commands] == ["prepare", "generate", "eval"]
    for line in commands:
        argv = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', line.replace("path/to/model",
                                                                             str(tmp_path / "model")))]
        out = subprocess.run([sys.executable, "-m", "dynaspec", *argv[1:], *(["--threads", "1"])],
                             cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, f"{line}\n{out.stderr[-3000:]}"
    manifest = json.loads((tmp_path / "my-model" / "prepare.json").read_text())
    assert manifest["target"] == str((tmp_path / "model").resolve())
    assert sorted(manifest["stages"]) == sorted(STAGES)


def test_prepare_defaults_to_the_targets_own_continuations_and_fused_layers():
    """A first run gets the recipe that made the shipped drafters good: generated continuations
    (96 tokens), fused features from a low and a middle layer, bfloat16 where native."""
    from dynaspec.training.prepare import auto_feature_layers

    budget = PrepareBudget()
    assert budget.source == "generated" and budget.new_tokens is None and budget.feature_layers == "auto"
    assert budget.dtype == "auto"
    assert auto_feature_layers(18) == (2, 9) and auto_feature_layers(24) == (3, 12)  # Gemma 3 270M, Qwen2.5-0.5B
    assert auto_feature_layers(2) == (0, 1) and auto_feature_layers(1) == (0,)
    assert PrepareBudget(feature_layers=()).feature_layers is None
    assert PrepareBudget(feature_layers=[3, 12]).feature_layers == (3, 12)


def test_init_continues_the_prepared_drafter_on_the_answers(prepared, tmp_path):
    out, _ = prepared
    again = tmp_path / "again"
    shutil.copytree(out, again)
    first = json.loads((out / "drafter" / "drafter.json").read_text())["training"]
    budget = attrs.evolve(BUDGET, steps=40, loss_on="answer", unroll=3)
    # --redo drafter clears ./drafter: the drafter it starts from was loaded before that
    manifest = prepare("tiny-llama", again, budget=budget, redo=("drafter",), only=("drafter",),
                       init=str(again / "drafter"), command="init")
    assert manifest["stages"]["drafter"]["command"] == "init"
    training = json.loads((again / "drafter" / "drafter.json").read_text())["training"]
    assert training["loss_on"] == "answer"
    assert training["unroll"] == 3 and first["unroll"] == 2  # --unroll reaches the training
    assert training["init"]["training"]["steps"] == first["steps"]  # the record it started from
    assert training["steps"] == 40  # a schedule of its own, not the first run's checkpoint resumed
    spec, plain = _plain_and_spec(again / "stack.toml")
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_accepted_length > 1.2  # still a drafter that drafts
    # a drafter with no training record to continue is refused, before anything is cleared
    trained_drafter("llama").save(tmp_path / "untracked")
    with pytest.raises(ConfigError, match="no training record"):
        prepare("tiny-llama", again, budget=budget, redo=("drafter",), only=("drafter",),
                init=str(tmp_path / "untracked"))
    assert (again / "drafter" / "drafter.json").exists()
    with pytest.raises(ValueError, match="answer"):
        attrs.evolve(BUDGET, loss_on="prompt")
    cli = [sys.executable, "-m", "dynaspec", "prepare", "--target", "tiny-llama", "--out", str(tmp_path / "z"),
           "--init", "x", "--drafter", "y"]
    done = subprocess.run(cli, capture_output=True, text=True)
    assert done.returncode != 0 and "give one of them" in done.stderr


def test_embed_norm_added_to_a_drafter_keeps_its_function_and_then_trains(prepared, tmp_path):
    import torch

    from dynaspec.runtime.drafter import Drafter
    from dynaspec.runtime.targets import load_target
    from dynaspec.training.drafter import embedding_rms, with_embed_norm

    out, _ = prepared
    start = trained_drafter("llama").float()
    assert not start.cfg.embed_norm and start.embed_norm is None
    d = start.cfg.hidden_size
    # token embeddings that all have RMS 0.02: the upgraded drafter computes exactly what it did
    emb = torch.nn.functional.normalize(torch.randn(2, 7, d), dim=-1) * (0.02 * d ** 0.5)
    feats, pos = torch.randn(2, 7, d), torch.arange(7)[None].expand(2, -1)
    normed = with_embed_norm(start, 0.02)
    assert normed.cfg.embed_norm and torch.all(normed.embed_norm.weight == 0.02)
    with torch.no_grad():
        # (up to the norm's epsilon: 1e-6 beside a mean square of 4e-4)
        torch.testing.assert_close(normed(emb, feats, pos), start(emb, feats, pos), rtol=1e-2, atol=2e-4)
        # and it is a norm: the scale of the embedding no longer reaches fc
        torch.testing.assert_close(normed(emb * 50, feats, pos), normed(emb, feats, pos), rtol=1e-2, atol=2e-4)
        assert not torch.allclose(start(emb * 50, feats, pos), start(emb, feats, pos), atol=1e-3)
    assert with_embed_norm(normed, 1.0) is normed  # one already there is kept
    target = load_target("tiny-llama")
    rms = embedding_rms(target, chunk=7)  # chunks that do not divide the vocabulary
    every = target.embed(torch.arange(target.vocab_size)).float().pow(2).mean(-1).sqrt()
    assert rms == pytest.approx(float(every.median()))
    # through prepare: --init without the norm, --embed-norm adds it; saved, loaded, exact
    again = tmp_path / "again"
    shutil.copytree(out, again)
    prepare("tiny-llama", again, budget=attrs.evolve(BUDGET, steps=10, embed_norm=True), redo=("drafter",),
            only=("drafter",), init=str(again / "drafter"), command="embed norm")
    loaded = Drafter.load(again / "drafter")
    assert loaded.cfg.embed_norm and loaded.embed_norm is not None
    assert not torch.allclose(loaded.embed_norm.weight.float(), torch.full((d,), rms), atol=1e-4)  # trained
    spec, plain = _plain_and_spec(again / "stack.toml")
    assert spec.token_ids == plain.token_ids


def test_init_with_a_wider_width_widens_the_drafter_keeping_its_function(prepared, tmp_path):
    import torch

    from dynaspec.training.drafter import widen

    out, _ = prepared
    start = trained_drafter("llama").float()
    wide = widen(start, 80)
    assert wide.cfg.intermediate_size == 80 and start.cfg.intermediate_size < 80
    emb, feats = torch.randn(2, 7, start.cfg.hidden_size), torch.randn(2, 7, start.cfg.hidden_size)
    pos = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():  # the same function at the start: the new units are silent
        assert torch.equal(start(emb, feats, pos), wide(emb, feats, pos))
    assert wide.layer.down_proj.weight[:, start.cfg.intermediate_size:].abs().sum() == 0
    assert wide.layer.gate_proj.weight[start.cfg.intermediate_size:].abs().sum() > 0  # random, not dead
    with pytest.raises(ConfigError, match="widened, not narrowed"):
        widen(wide, 16)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    budget = attrs.evolve(BUDGET, steps=20, drafter_width=64)
    prepare("tiny-llama", again, budget=budget, redo=("drafter",), only=("drafter",),
            init=str(again / "drafter"), command="widen")
    assert json.loads((again / "drafter" / "drafter.json").read_text())["architecture"]["intermediate_size"] == 64
    spec, plain = _plain_and_spec(again / "stack.toml")
    assert spec.token_ids == plain.token_ids
    # narrower than the drafter it starts from: refused before ./drafter is cleared
    with pytest.raises(ConfigError, match="widened, not narrowed"):
        prepare("tiny-llama", again, budget=attrs.evolve(budget, drafter_width=32), redo=("drafter",),
                only=("drafter",), init=str(again / "drafter"))
    assert (again / "drafter" / "drafter.json").exists()


def test_an_interrupted_redo_resumes_from_its_checkpoint(prepared, tmp_path, monkeypatch):
    out, _ = prepared
    again = tmp_path / "again"
    shutil.copytree(out, again)
    import dynaspec.training.drafter as drafter_mod

    real_save, real_load = drafter_mod._save_checkpoint, drafter_mod._load_checkpoint

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    loaded = []

    def load(*args, **kwargs):
        state = real_load(*args, **kwargs)
        loaded.append(state and state["step"])
        return state

    monkeypatch.setattr(drafter_mod, "_save_checkpoint", save_then_stop)
    monkeypatch.setattr(drafter_mod, "_load_checkpoint", load)
    with pytest.raises(KeyboardInterrupt):
        prepare("tiny-llama", again, budget=BUDGET, redo=("drafter",), only=("drafter",))
    assert "drafter" not in json.loads((again / prep.MANIFEST).read_text())["stages"]
    monkeypatch.setattr(drafter_mod, "_save_checkpoint", real_save)
    manifest = prepare("tiny-llama", again, budget=BUDGET, redo=("drafter",), only=("drafter",), command="resumed")
    # the first run started afresh; the same command resumed at the checkpoint it stopped after
    assert loaded[0] is None and len(loaded) == 2 and loaded[1] > 0
    assert manifest["stages"]["drafter"]["command"] == "resumed"
    assert (again / "drafter" / "drafter.json").exists()


def test_sampled_continuations_are_collected_and_trained_on(prepared, tmp_path):
    """``--sampled 1``: a redo of collect keeps the greedy shards and adds the same prompts'
    sampled continuations in work-sampled-0 (shards of their own kind); the drafter stage then
    trains on both folders and records them; bad settings are refused before anything runs."""
    from dynaspec.training.shards import shard_kind, shard_paths

    out, _ = prepared
    again = tmp_path / "again"
    shutil.copytree(out, again)
    greedy = [p.read_bytes() for p in shard_paths(again / "work")]
    budget = attrs.evolve(BUDGET, sampled=1, temperature=0.8, steps=30)
    manifest = prepare("tiny-llama", again, budget=budget, redo=("collect", "drafter"),
                       only=("collect", "drafter"), init=str(again / "drafter"), command="sampled")
    assert [p.read_bytes() for p in shard_paths(again / "work")] == greedy  # nothing collected again
    sampled = shard_paths(again / "work-sampled-0")
    assert len(sampled) == 4 and shard_kind(sampled[0])["sampling"] != "greedy"
    collect = manifest["stages"]["collect"]
    assert collect["outputs"] == ["work", "work-sampled-0"] and collect["sampled"][0]["shards"] == 4
    assert manifest["budget"]["sampled"] == 1 and manifest["budget"]["temperature"] == 0.8
    training = json.loads((again / "drafter" / "drafter.json").read_text())["training"]
    assert training["work"] == ["work", "work-sampled-0"] and training["command"] == "sampled"
    spec, plain = _plain_and_spec(again / "stack.toml")
    assert spec.token_ids == plain.token_ids
    for bad, message in ((["--sampled", "1", "--temperature", "0"], "above 0"),
                         (["--sampled", "1", "--source", "raw"], "needs --source generated")):
        cli = [sys.executable, "-m", "dynaspec", "prepare", "--target", "tiny-llama", "--out",
               str(tmp_path / "z"), *bad]
        done = subprocess.run(cli, capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert not (tmp_path / "z").exists()


def test_later_turns_are_collected_as_their_own_kind(tmp_path):
    """``--turns later``: collect's prompts are later human turns (shards say so, and their ids name
    the turn), recorded in the manifest's budget; an unknown choice is refused."""
    from dynaspec.training.shards import shard_kind, shard_metadata, shard_paths

    budget = attrs.evolve(BUDGET, prompts=4, turns="later")
    manifest = prepare("tiny-llama", tmp_path / "later", budget=budget, only=("collect",), command="later")
    shards = shard_paths(tmp_path / "later" / "work")
    assert len(shards) == 1 and shard_kind(shards[0])["turns"] == "later"
    assert all("#" in i for i in json.loads(shard_metadata(shards[0])["ids"]))
    assert manifest["budget"]["turns"] == "later"
    with pytest.raises(ValueError):
        PrepareBudget(turns="middle")
    done = subprocess.run([sys.executable, "-m", "dynaspec", "prepare", "--target", "tiny-llama", "--out",
                           str(tmp_path / "z"), "--turns", "middle"], capture_output=True, text=True)
    assert done.returncode != 0 and "--turns" in done.stderr and not (tmp_path / "z").exists()


def test_more_data_trains_on_other_prepare_folders_and_refuses_bad_ones(prepared, tmp_path):
    """``--more-data``: the drafter, frequency, corpus and router stages read another prepare folder's
    collection beside this folder's own (here: none of its own, a later-turns collection still
    without its manifest, and the prepared folder's first turns); the record names the folders as given, not machine paths; a
    folder that is not a prepare folder, one of another target, one without shards and --out
    itself are refused before anything runs."""
    import os

    from dynaspec.training.shards import shard_paths

    out, _ = prepared
    later = tmp_path / "later"
    budget = attrs.evolve(BUDGET, prompts=4, turns="later")
    prepare("tiny-llama", later, budget=budget, only=("collect",), command="later")
    (later / prep.MANIFEST).unlink()  # as a collection still running: its shards name the target
    both = tmp_path / "both"
    shutil.copytree(out / "clusters", both / "clusters")  # the stages below need clusters of their own
    old = os.getcwd()
    os.chdir(tmp_path)  # the folders as a user gives them: relative
    try:
        manifest = prepare("tiny-llama", Path("both"), budget=attrs.evolve(BUDGET, steps=30),
                           only=("drafter", "frequency", "corpus", "router", "stack"), command="both",
                           init=str(out / "drafter"), more_data=("later", str(out)))
    finally:
        os.chdir(old)
    assert not shard_paths(both / "work")  # it collected nothing itself
    training = json.loads((both / "drafter" / "drafter.json").read_text())["training"]
    assert training["work"][0] == "work" and training["work"][1] == "later/work"
    assert training["work"][2].endswith("/work") and training["shards_at_end"] == 1 + 4
    assert "5 shards of human turns (1 of them later turns" in training["data"]
    assert manifest["stages"]["corpus"]["shards"] == 1 + 4  # the greedy answers of both folders
    _, counted = load_frequency(both / "frequency", None)
    assert "of 5 collected shards" in counted["corpus"], counted  # the frequency list counts both too
    assert (both / "router").exists() and (both / "stack.toml").exists()
    spec, plain = _plain_and_spec(both / "stack.toml")
    assert spec.token_ids == plain.token_ids
    gemma_like = tmp_path / "other"
    gemma_like.mkdir()
    (gemma_like / prep.MANIFEST).write_text(json.dumps({"format": prep.FORMAT, "target": "tiny-gemma",
                                                          "fingerprint": {"model_type": "gemma3"}, "stages": {}}))
    empty = tmp_path / "empty"
    prepare("tiny-llama", empty, budget=BUDGET, only=("stack",), command="empty")
    for folder, message in ((tmp_path / "nothing", "no prepare.json"), (gemma_like, "prepared for target 'tiny-gemma'"),
                            (empty, "no collected shards"), (both, "that is --out itself")):
        with pytest.raises(ConfigError, match=message):
            prepare("tiny-llama", both, budget=BUDGET, only=("drafter",), redo=("drafter",), more_data=(folder,))
    assert (both / "drafter" / "drafter.json").exists()  # nothing was cleared by a refused run
