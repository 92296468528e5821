"""The artifacts shipped for the embedded default (Gemma) and for Qwen: present, small, consistent
with each other and with the shipped drafter's target, refused by another target (fast: the targets
themselves are not loaded)."""

from __future__ import annotations

import json

import pytest

from dynaspec.errors import ArtifactMismatchError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.targets import resolve_artifact
from dynaspec.shortlisters.clusters import load_clusters
from dynaspec.shortlisters.frequency import load_frequency
from dynaspec.shortlisters.router import Router, cluster_digest

GEMMA = resolve_artifact("gemma3-270m")
SHIPPED = ["gemma3-270m", "qwen2.5-coder-0.5b"]


def gemma_fingerprint() -> dict:
    return json.loads((GEMMA / "drafter.json").read_text())["target"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shortlisting_artifacts_are_shipped_and_small(name):
    folder = resolve_artifact(name)
    names = ["clusters.safetensors", "router.safetensors", "frequency.safetensors"]
    sizes = {n: (folder / n).stat().st_size for n in names}
    assert sum(sizes.values()) < 20 * 2**20, sizes
    # bfloat16, one decoder layer; a drafter with fused features adds its fuse matrix (Qwen: 4.8 MB)
    assert (folder / "drafter.safetensors").stat().st_size < 24 * 2**20


@pytest.mark.parametrize("name", SHIPPED)
def test_artifacts_agree_with_the_drafters_target_and_each_other(name):
    folder = resolve_artifact(name)
    fingerprint = json.loads((folder / "drafter.json").read_text())["target"]
    clusters = load_clusters(folder, fingerprint)
    router, meta = Router.load(folder, fingerprint)
    ranked, _ = load_frequency(folder, fingerprint)
    vocab = fingerprint["vocab_size"]
    assert clusters["assignment"].numel() == vocab == ranked.numel()
    assert sorted(ranked.tolist()[:1000]) != list(range(1000))  # a real ranking, not the identity
    assert router.cfg.clusters == clusters["centroids"].shape[0]
    assert meta["clusters_sha"] == cluster_digest(clusters["assignment"])


@pytest.mark.parametrize("load", [lambda fp: load_clusters(GEMMA, fp), lambda fp: Router.load(GEMMA, fp),
                                  lambda fp: load_frequency(GEMMA, fp)])
def test_shipped_artifacts_refuse_another_target(load):
    with pytest.raises(ArtifactMismatchError):
        load(tiny_target("llama").fingerprint())


def test_no_machine_paths_ship():
    """Provenance names folders by their last component only (scripts/ship_artifacts.py): no
    absolute path of the machine that trained an artifact is in the package."""
    import re

    from safetensors import safe_open

    absolute = re.compile(r"(?<![\w.~-])/(?:[\w.+-]+/)+[\w.+-]+")
    folders = [p for p in GEMMA.parent.iterdir() if p.is_dir()]
    checked = 0
    for path in (f for folder in folders for f in folder.iterdir()):
        if path.suffix == ".json":
            text = path.read_text()
        elif path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as fh:
                text = json.dumps(fh.metadata() or {})
        else:
            continue
        checked += 1
        assert not absolute.search(text), (path.name, absolute.search(text).group(0))
    assert checked >= 5
