"""Drafter and router training under ``torchrun`` (DistributedDataParallel, gloo on CPU): two
processes splitting each batch train the same weights as one process on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dynaspec.plugins.tiny import tiny_target
from dynaspec.training import collect as dc

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def _run(argv: list[str], processes: int, cwd) -> None:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "dynaspec"] if processes > 1 else [sys.executable, "-m", "dynaspec"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*launch, *argv], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    texts = ["def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog.",
             "Hola, como estas? Muy bien, gracias.", "for i in range(10):\n    print(i * i)"] * 3

    def prompt_batches(tokenizer, start, count, max_prompt_tokens, split="train", slice_name=None, fmt=None, turns="first"):
        return [(f"t{k}", tokenizer(texts[k])["input_ids"]) for k in range(start, min(start + count, len(texts)))]

    mp = pytest.MonkeyPatch()
    mp.setattr(dc, "_prompt_batches", prompt_batches)
    dc.collect(tiny_target("llama"), root / "work", prompts=12, shard_size=4, batch=4, new_tokens=24)
    mp.undo()
    return root


def _weights(folder, name):
    return load_file(str(folder / name))


def test_two_processes_train_the_drafter_of_one(shards):
    common = ["train-drafter", "--target", "tiny-llama", "--stage", "train", "--work", "work", "--steps", "6",
              "--batch-positions", "96", "--window", "24", "--threads", "1",
              "--precision", "float32"]  # bfloat16 products round a split batch otherwise
    _run([*common, "--out", "one"], 1, shards)
    _run([*common, "--out", "two"], 2, shards)
    assert (shards / "two" / "drafter.safetensors").exists()  # written once, by rank 0
    processes = [json.loads((shards / out / "drafter.json").read_text())["training"]["processes"] for out in ("one", "two")]
    assert processes == [1, 2]  # the record says how the run was split
    # the float32 checkpoints of the last step: equal up to the order of the gradient sums
    one = _weights(shards / "work" / "ckpt-one", "checkpoint.safetensors")
    two = _weights(shards / "work" / "ckpt-two", "checkpoint.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5, rtol=1e-4), key
    # and training moved the weights: the comparison is not between two initialisations
    from dynaspec.runtime.drafter import Drafter, DrafterConfig

    torch.manual_seed(0)
    init = Drafter(DrafterConfig.like_target(tiny_target("llama").model)).state_dict()
    assert (one["model.fc.weight"] - init["fc.weight"]).abs().max() > 1e-3


def test_two_processes_train_the_router_of_one(shards):
    _run(["build-clusters", "--target", "tiny-llama", "--clusters", "8", "--out", "clusters"], 1, shards)
    common = ["train-router", "--target", "tiny-llama", "--work", "work", "--clusters", "clusters",
              "--width", "16", "--epochs", "4", "--batch", "64", "--threads", "1"]
    _run([*common, "--out", "router-one"], 1, shards)
    _run([*common, "--out", "router-two"], 2, shards)
    from dynaspec.shortlisters.router import Router

    (one, meta), (two, _) = (Router.load(shards / name, None) for name in ("router-one", "router-two"))
    assert meta["training"]["examples"] >= 2 * 64  # several optimiser steps ran (x 4 epochs)
    for (key, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        # stored in bfloat16: equal up to one rounding step of the last bit
        assert ((a - b).abs() <= a.abs() * 2 ** -7 + 1e-6).all(), key
    # the steps matter: a shorter run of one process ends elsewhere
    _run([*[a if a != "4" else "1" for a in common], "--out", "router-short"], 1, shards)
    short, _ = Router.load(shards / "router-short", None)
    assert any((a - b).abs().max() > 1e-2 for a, b in zip(one.state_dict().values(), short.state_dict().values()))


def test_prepare_under_torchrun_builds_what_one_process_builds(tmp_path):
    """`dynaspec prepare` on two processes: the collection is shared shard by shard (the same
    shards, bit for bit), the drafter and router are trained together, the single-process stages
    and the manifest are rank 0's; the result is a working stack."""
    import json

    from dynaspec.training.shards import load_shard, shard_paths

    common = ["prepare", "--target", "tiny-llama", "--prompts", "8", "--shard-size", "2", "--source", "generated",
              "--new-tokens", "16", "--steps", "12", "--batch-positions", "128", "--router-width", "16",
              "--threads", "1", "--precision", "float32",  # bfloat16 products round a split batch otherwise
              "--unroll", "3"]
    _run([*common, "--out", "one"], 1, tmp_path)
    _run([*common, "--out", "two"], 2, tmp_path)
    one, two = shard_paths(tmp_path / "one" / "work"), shard_paths(tmp_path / "two" / "work")
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 4
    for a, b in zip(one, two):
        sa, sb = load_shard(a), load_shard(b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    manifest = json.loads((tmp_path / "two" / "prepare.json").read_text())
    assert sorted(manifest["stages"]) == sorted(["collect", "drafter", "frequency", "corpus", "clusters", "router", "stack"])
    assert manifest["budget"]["unroll"] == 3
    assert json.loads((tmp_path / "two" / "drafter" / "drafter.json").read_text())["training"]["unroll"] == 3
    w1 = _weights(tmp_path / "one" / "work" / "ckpt-drafter", "checkpoint.safetensors")
    w2 = _weights(tmp_path / "two" / "work" / "ckpt-drafter", "checkpoint.safetensors")
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4) for k in w1)
    out = subprocess.run([sys.executable, "-m", "dynaspec", "generate", "Hello", "--stack",
                          str(tmp_path / "two" / "stack.toml"), "--max-new-tokens", "8", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
