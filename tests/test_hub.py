"""Hugging Face Hub ids (``owner/name``) for targets and EAGLE drafters: passed to the Hub's download
(here replaced by a local folder: the tests run offline), and a clear error where it fails."""

from __future__ import annotations

import pytest
import torch
from test_eagle import _eagle_config, _eagle_weights, _write

from conftest import target
from dynaspec.errors import ConfigError, UnknownComponentError
from dynaspec.runtime.targets import load_drafter, load_target, looks_like_hub_id


def test_what_counts_as_a_hub_id(tmp_path):
    assert looks_like_hub_id("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert not looks_like_hub_id("gemma3-270m") and not looks_like_hub_id("./a/b")
    assert not looks_like_hub_id("/abs/path") and not looks_like_hub_id("a/b/c")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not looks_like_hub_id(str(tmp_path / "owner" / "name"))


def test_hub_ids_are_downloaded_for_targets_and_drafters(tmp_path, monkeypatch):
    import huggingface_hub

    tiny = target("llama")
    tiny.model.save_pretrained(tmp_path / "model")
    tiny.tokenizer.save_pretrained(tmp_path / "model")
    eagle = _write(tmp_path / "eagle", _eagle_config(tiny), _eagle_weights(tiny))
    asked = []

    def fake_download(repo_id, **kwargs):
        asked.append(repo_id)
        return str({"someone/tiny-model": tmp_path / "model", "someone/tiny-eagle": eagle}[repo_id])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    loaded = load_target("someone/tiny-model")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded.model(ids).logits, tiny.model(ids).logits, atol=1e-5)
    assert load_drafter("someone/tiny-eagle", loaded).fc.weight.shape == (tiny.hidden_size, 2 * tiny.hidden_size)
    assert asked == ["someone/tiny-model", "someone/tiny-eagle"]


def test_a_failed_download_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match=r"target 'nobody/missing' is not here .*Hub failed: OSError: network"):
        load_target("nobody/missing")
    with pytest.raises(ConfigError, match=r"drafter 'nobody/eagle' is not here and downloading"):
        load_drafter("nobody/eagle", target("llama"))
    with pytest.raises(UnknownComponentError, match="nor a Hugging Face Hub id"):
        load_target("no-such-target")
