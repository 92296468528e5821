"""Ready-to-map images of a target (dynaspec.runtime.image): a target restored from its image computes
bit for bit what the target it was saved from computes, through the same probed kernels; starts
map the image; a damaged or mismatched image is never used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import builtin_registry, random_drafter
from dynaspec import Component, hookimpl
from dynaspec.errors import ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime import image as images
from dynaspec.runtime import q8
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.image import ImageTarget, load_image, save_image

Q8 = q8.available() is None
#: the cache the suite runs with (the real target is converted there once)
SUITE_CACHE = os.environ.get("DYNASPEC_CACHE_DIR")
VNNI = Q8 and "int8" in q8.modes()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNASPEC_IMAGES", "1")
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DYNASPEC_VERDICTS_FILE", str(tmp_path / "verdicts.json"))


def _stack(kind: str, dtype: str, weights: str, drafter: bool = True):
    return stack_from_mapping({"name": "img", "target": f"tiny-{kind}", "drafter": "in-memory" if drafter else None,
                               "dtype": dtype, "weights": weights, "draft": {"mode": "chain", "depth": 4}})


CASES = [("llama", "float32", "dtype", {}), ("llama", "bfloat16", "dtype", {"attention_bias": True}),
         ("gemma3", "bfloat16", "dtype", {"tie_word_embeddings": False})]
if Q8:
    CASES += [("gemma3", "float32", "int8", {}), ("llama", "bfloat16", "int8", {"attention_bias": True})]
if VNNI:
    CASES += [("llama", "bfloat16", "w8a8", {}), ("gemma3", "bfloat16", "w8a8", {})]


@pytest.mark.parametrize("kind,dtype,weights,config", CASES)
def test_an_image_computes_what_its_target_computes(tmp_path, kind, dtype, weights, config):
    registry = builtin_registry()
    target = tiny_target(kind, **config).to(dtype=dtype)
    stack = _stack(kind, dtype, weights)
    drafter = random_drafter(kind)
    full = Engine(stack, target, drafter, registry=registry)
    assert save_image(target, tmp_path / "image", source_id="test")
    mapped = load_image(tmp_path / "image")
    assert isinstance(mapped, ImageTarget) and mapped.model is None
    engine = Engine(stack, mapped, drafter, registry=registry)
    assert (mapped.dtype, mapped.weights, mapped.fingerprint()) == (target.dtype, target.weights, target.fingerprint())
    assert mapped.eos_token_ids == target.eos_token_ids and mapped.special_token_ids == target.special_token_ids
    assert mapped.parameter_count == target.parameter_count and mapped.vocab_size == target.vocab_size
    # the same verdicts for every product the lean forward and the head compute, and the guarantee
    assert mapped.batch_invariance == target.products_in_use()
    assert engine.exactness == full.exactness == "guaranteed"
    ids = torch.arange(3, 40)
    want = target.forward(ids, torch.arange(len(ids)), target.new_cache(64), layers=[0, 2])
    got = mapped.forward(ids, torch.arange(len(ids)), mapped.new_cache(64), layers=[0, 2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(mapped.logits(got[0][-5:]), target.logits(want[0][-5:]))
    assert torch.equal(mapped.embed(ids), target.embed(ids))
    for prompt in ("Hello world, this is", "def f(x):\n"):
        a, b = full.generate(prompt, max_new_tokens=24), engine.generate(prompt, max_new_tokens=24)
        assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids) == 24
        assert b.stats.cycles > 0  # it speculated
    # plain decoding on the image equals speculative decoding on it (the guarantee holds there)
    plain = Engine(stack_from_mapping({"name": "p", "target": f"tiny-{kind}", "drafter": None, "dtype": dtype,
                                       "weights": weights}), mapped, registry=registry)
    assert plain.generate("Hello world, this is", max_new_tokens=24).token_ids == \
        engine.generate("Hello world, this is", max_new_tokens=24).token_ids


def test_the_image_tokenizer_encodes_and_decodes_as_the_original(tmp_path):
    target = tiny_target("llama")
    Engine(_stack("llama", "float32", "dtype", drafter=False), target, registry=builtin_registry())
    assert save_image(target, tmp_path / "image", source_id="test")
    tok = load_image(tmp_path / "image").tokenizer
    ref = target.tokenizer
    for text in ("Hello world", "a\nb  c", "x" * 50):
        ids = ref(text)["input_ids"]
        assert tok(text)["input_ids"] == ids and ids[0] == ref.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == ref.decode(ids)
    assert (tok.eos_token_id, tok.bos_token_id, tok.bos_token) == (ref.eos_token_id, ref.bos_token_id, ref.bos_token)
    assert tok._hf is None  # all of that without the Hugging Face tokenizer
    # anything else comes from the Hugging Face tokenizer saved beside it
    assert tok.convert_ids_to_tokens([5, 6]) == ref.convert_ids_to_tokens([5, 6])
    assert tok._hf is not None and len(tok) == len(ref)


def test_an_image_target_keeps_its_dtype_and_weights(tmp_path):
    target = tiny_target("llama")
    Engine(_stack("llama", "float32", "dtype", drafter=False), target, registry=builtin_registry())
    save_image(target, tmp_path / "image", source_id="test")
    mapped = load_image(tmp_path / "image")
    assert mapped.to(dtype=torch.float32) is mapped
    with pytest.raises(ConfigError, match="restored from an image in torch.float32"):
        mapped.to(dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match='weights = "dtype", not "int8"'):
        mapped.use_weights("int8")


def test_an_unprobed_target_or_one_without_the_lean_forward_saves_no_image(tmp_path):
    assert not save_image(tiny_target("llama"), tmp_path / "a", source_id="test")  # not set up
    generic = tiny_target("llama")
    generic.forward_kind = "generic"
    Engine(_stack("llama", "float32", "dtype", drafter=False), generic, registry=builtin_registry())
    assert not save_image(generic, tmp_path / "b", source_id="test")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.skipif(not Q8, reason="the int8 kernel does not build here")
def test_packed_weights_restore_only_for_the_kernel_they_were_packed_for():
    weight = torch.randn(20, 70)
    kernel = q8.Int8WeightLinear(weight, torch.randn(20))
    tensors, meta = kernel.state()
    restored = q8.Int8WeightLinear.from_state(tensors, meta)
    x = torch.randn(3, 70)
    assert torch.equal(restored(x), kernel(x))
    with pytest.raises(ValueError, match="packed for lanes and tile rows"):
        q8.Int8WeightLinear.from_state(tensors, {**meta, "layout": [meta["layout"][0] * 2, meta["layout"][1]]})
    with pytest.raises(ValueError, match="'scale' missing or not"):
        q8.Int8WeightLinear.from_state({**tensors, "scale": tensors["scale"][:-1]}, meta)
    with pytest.raises(ValueError, match="'packed' missing"):
        q8.Int8WeightLinear.from_state({k: v for k, v in tensors.items() if k != "packed"}, meta)


# -- starts through Engine.from_stack -----------------------------------------------------------------
LOADS = []


class _ImagedTarget:
    """A tiny target under a name whose plugin declares an image id (as the built-in real targets do)."""

    @hookimpl
    def dynaspec_targets(self):
        def factory(params, ctx):
            LOADS.append(1)
            return tiny_target("gemma3")

        return [Component("imaged-tiny", factory, "tiny Gemma 3 with images", image_id="imaged-tiny-v1")]


def _from_stack(registry, weights="dtype"):
    stack = stack_from_mapping({"name": "s", "target": "imaged-tiny", "drafter": None, "dtype": "float32",
                                "weights": weights})
    return Engine.from_stack(stack, registry=registry)


def test_the_first_start_saves_an_image_and_later_starts_map_it(monkeypatch, capsys):
    registry = builtin_registry(_ImagedTarget())
    LOADS.clear()
    first = _from_stack(registry)
    assert not isinstance(first.target, ImageTarget) and len(LOADS) == 1
    second = _from_stack(registry)
    assert isinstance(second.target, ImageTarget) and len(LOADS) == 1  # mapped: the plugin was not called
    assert second.generate("Hello", max_new_tokens=12).token_ids == first.generate("Hello", max_new_tokens=12).token_ids
    folder = images.image_dir("imaged-tiny", "imaged-tiny-v1", torch.float32, "dtype", torch.device("cpu"))
    assert second.target.image == str(folder)
    # an image of the same setting under another key (an earlier version, say) is removed on saving
    stale = folder.with_name(folder.name[:-12] + "0" * 12)
    stale.mkdir()
    (stale / images.TENSORS).write_bytes(b"old")
    folder.rename(folder.with_name(folder.name + "-x"))  # out of the way: the next start saves again
    _from_stack(registry)
    assert len(LOADS) == 2 and folder.exists() and not stale.exists() and folder.with_name(folder.name + "-x").exists()
        # another weights setting is another image
    if Q8:
        assert not isinstance(_from_stack(registry, "int8").target, ImageTarget) and len(LOADS) == 3
        assert isinstance(_from_stack(registry, "int8").target, ImageTarget) and len(LOADS) == 3
    # turned off: loaded in full every time
    monkeypatch.setenv("DYNASPEC_IMAGES", "0")
    assert not isinstance(_from_stack(registry).target, ImageTarget)


@pytest.mark.parametrize("damage", ["truncate", "meta", "layout"])
def test_a_damaged_image_is_refused_removed_and_saved_again(damage, capsys):
    registry = builtin_registry(_ImagedTarget())
    weights = "int8" if damage == "layout" else "dtype"
    if damage == "layout" and not Q8:
        pytest.skip("the int8 kernel does not build here")
    _from_stack(registry, weights)
    folder = images.image_dir("imaged-tiny", "imaged-tiny-v1", torch.float32, weights, torch.device("cpu"))
    assert isinstance(_from_stack(registry, weights).target, ImageTarget)
    if damage == "truncate":
        path = folder / images.TENSORS
        path.write_bytes(path.read_bytes()[:-100])
    else:
        meta = json.loads((folder / images.META).read_text())
        if damage == "meta":
            meta["format"] = 999
        else:  # packed for another instruction set: what the kernel checks, beyond the manifest
            for state in meta["q8"].values():
                state["layout"][0] *= 2
        (folder / images.META).write_text(json.dumps(meta))
        from dynaspec.runtime.cache import write_manifest

        write_manifest(folder, images.IMAGE_FORMAT, {})  # a consistent manifest over the edit
    capsys.readouterr()
    LOADS.clear()
    engine = _from_stack(registry, weights)
    assert not isinstance(engine.target, ImageTarget) and LOADS == [1]
    assert "is unusable" in capsys.readouterr().err
    assert isinstance(_from_stack(registry, weights).target, ImageTarget)  # saved again, whole


def test_the_generate_command_exits_with_its_output_written(tmp_path):
    """``dynaspec generate`` ends its process without the interpreter's teardown: all of its
    output must be out first, and its exit status kept."""
    env = {**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path / "c")}
    out = subprocess.run([sys.executable, "-m", "dynaspec", "generate", "Hello", "--stack", "tiny-baseline",
                          "--max-new-tokens", "5", "--json", "--threads", "1"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 5
    bad = subprocess.run([sys.executable, "-m", "dynaspec", "generate", "", "--stack", "tiny-baseline"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "error" in bad.stderr


def test_the_real_target_from_its_image(tmp_path, monkeypatch):
    """Gemma 3 270M (the suite's real target, bfloat16 where native, its auto weights): mapped from
    its image it gives the tokens the target loaded in full gives, speculating."""
    if SUITE_CACHE:  # the suite's cache, where the real target is converted once
        monkeypatch.setenv("DYNASPEC_CACHE_DIR", SUITE_CACHE)
    else:
        monkeypatch.delenv("DYNASPEC_CACHE_DIR")
    monkeypatch.setenv("DYNASPEC_IMAGES", "0")  # loaded in full, whatever images that cache holds
    torch.set_num_threads(1)
    full = Engine.from_stack("gemma")
    assert not isinstance(full.target, ImageTarget)
    assert save_image(full.target, tmp_path / "image", source_id="test")
    mapped = Engine.from_stack("gemma", target=load_image(tmp_path / "image"))
    assert mapped.target.weights == full.target.weights and mapped.exactness == "guaranteed"
    assert mapped.target.tokenizer._hf is None
    for text in ("The capital of France is", "def fibonacci(n):"):
        a, b = full.generate(text, max_new_tokens=32), mapped.generate(text, max_new_tokens=32)
        assert a.token_ids == b.token_ids and a.text == b.text
        assert b.stats.cycles < 32
