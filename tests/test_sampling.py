"""Lossless sampling: the speculative sampler's tokens have the target's distribution.

A target with a 12-token vocabulary lets us compute the exact distribution of the 2nd and 3rd
generated tokens (both produced by draft-verify cycles; the 1st comes from the prefill) and compare
thousands of speculative samples to it with a chi-square test at a fixed seed. A deliberately
wrong verifier must fail the same test, which shows the test can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import builtin_registry
from dynaspec.plugins.tiny import tiny_target
from dynaspec.plugins.verifiers import SamplingVerifier, sampling_distribution
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.drafter import Drafter, DrafterConfig
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.protocols import DecodeParams
from plugins_for_tests import TestPlugin

VOCAB = 12
PROMPT = [0, 3, 5]
SAMPLES = 2500


@pytest.fixture(scope="module")
def small():
    tgt = tiny_target("llama", vocab_size=VOCAB, seed=2)
    torch.manual_seed(5)
    return tgt, Drafter(DrafterConfig.like_target(tgt.model)).eval()


@torch.no_grad()
def exact_marginals(tgt, params: DecodeParams) -> tuple[np.ndarray, np.ndarray]:
    """P(y2) and P(y3) by enumerating y1, y2 under the target's processed distribution."""
    def dist(ids):
        logits = tgt.model(torch.tensor([ids])).logits[0, -1].float()
        return sampling_distribution(logits, params).numpy().astype(np.float64)

    p1 = dist(PROMPT)
    p2, p3 = np.zeros(VOCAB), np.zeros(VOCAB)
    for y1 in range(VOCAB):
        if p1[y1] == 0:
            continue
        q2 = dist(PROMPT + [y1])
        p2 += p1[y1] * q2
        for y2 in range(VOCAB):
            if q2[y2] > 0:
                p3 += p1[y1] * q2[y2] * dist(PROMPT + [y1, y2])
    return p2, p3


def sample_counts(engine, params: DecodeParams) -> tuple[np.ndarray, np.ndarray]:
    c2, c3 = np.zeros(VOCAB), np.zeros(VOCAB)
    for seed in range(SAMPLES):
        ids = engine.generate(PROMPT, max_new_tokens=3, temperature=params.temperature,
                              top_p=params.top_p, seed=seed).token_ids
        c2[ids[1]] += 1
        c3[ids[2]] += 1
    return c2, c3


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = probs[support] * counts.sum()
    return float(chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue)


def _engine(small, registry, **fields):
    tgt, drafter = small
    data = {"name": "s", "target": "tiny", "drafter": "d", "verifier": "sampling"}
    data.update(fields)
    return Engine(stack_from_mapping(data), tgt, drafter, registry=registry)


CASES = [
    ("chain-T1", dict(draft={"mode": "chain", "depth": 3}), DecodeParams(1.0, 1.0)),
    ("tree-T0.7-top_p0.9", dict(draft={"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 9}),
     DecodeParams(0.7, 0.9)),
    # drafts can never propose the target's likeliest tokens: they must come from residuals
    ("tree-excluding-top", dict(draft={"mode": "tree", "depth": 2, "topk": 4, "total_tokens": 8},
                                shortlister={"name": "exclude", "exclude": "TOP"}), DecodeParams(1.0, 1.0)),
]


@pytest.mark.parametrize("name,fields,params", CASES, ids=[c[0] for c in CASES])
def test_sampling_keeps_target_distribution(small, name, fields, params):
    p2, p3 = exact_marginals(small[0], params)
    if fields.get("shortlister", {}).get("exclude") == "TOP":
        top = [int(i) for i in np.argsort(-(p2 + p3))[:3]]
        fields = {**fields, "shortlister": {"name": "exclude", "exclude": top}}
    engine = _engine(small, builtin_registry(TestPlugin()), **fields)
    c2, c3 = sample_counts(engine, params)
    assert chi2_pvalue(c2, p2) > 1e-3 and chi2_pvalue(c3, p3) > 1e-3
    # total variation distance is small too (sampling noise at this size is ~0.03)
    assert 0.5 * np.abs(c2 / SAMPLES - p2).sum() < 0.06


def test_sampling_with_context_tokens_in_the_shortlist_keeps_target_distribution(small, tmp_path):
    """A routed shortlist of one 3-token cluster plus the context tokens it misses (a gathered tail
    after the cluster spans): drafts come from ever-changing, partial shortlists, and the samples
    still follow the target's distribution."""
    from dynaspec.shortlisters.clusters import save_clusters
    from dynaspec.shortlisters.router import Router, RouterConfig

    tgt = small[0]
    assignment = torch.arange(VOCAB) % 4
    save_clusters(tmp_path / "clusters", assignment, torch.eye(4, tgt.hidden_size),
                  {"target": tgt.fingerprint()})
    torch.manual_seed(3)
    Router(RouterConfig(tgt.hidden_size, 16, 4)).save(tmp_path / "router", {"target": tgt.fingerprint()})
    params = DecodeParams(1.0, 1.0)
    engine = _engine(small, builtin_registry(), draft={"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 9},
                     shortlister={"name": "dynaspec", "clusters": str(tmp_path / "clusters"),
                                  "router": str(tmp_path / "router"), "context": 2},
                     scheduler={"name": "fixed", "budget": 1, "unit": "clusters"},
                     backend="torch-blocked")
    p2, p3 = exact_marginals(tgt, params)
    c2, c3 = sample_counts(engine, params)
    assert chi2_pvalue(c2, p2) > 1e-3 and chi2_pvalue(c3, p3) > 1e-3
    assert 0.5 * np.abs(c2 / SAMPLES - p2).sum() < 0.06
    # the shortlists really were partial and really had a tail (one special + 3 tokens per cluster)
    sizes = [n for seed in range(20) for per_depth in engine.generate(
        PROMPT, max_new_tokens=3, temperature=1.0, seed=seed).stats.shortlist_sizes.values() for n in per_depth]
    assert max(sizes) < VOCAB and any(n % 3 != 1 for n in sizes)


class AcceptAlways(SamplingVerifier):
    """A broken verifier: accepts every drafted token (outputs the draft distribution)."""

    def verify(self, tree, logits, params, generator):
        path, node = [], 0
        while tree.children.get(node):
            node = tree.children[node][0]
            path.append(node)
        return path, int(torch.multinomial(sampling_distribution(logits[node], params), 1,
                                           generator=generator))


def test_the_test_detects_a_wrong_sampler(small):
    from dynaspec import Component, hookimpl

    class Broken:
        @hookimpl
        def dynaspec_verifiers(self):
            return [Component("accept-always", lambda p, c: AcceptAlways())]

    params = DecodeParams(1.0, 1.0)
    p2, p3 = exact_marginals(small[0], params)
    engine = _engine(small, builtin_registry(Broken()), verifier="accept-always",
                     draft={"mode": "chain", "depth": 3})
    c2, c3 = sample_counts(engine, params)
    assert min(chi2_pvalue(c2, p2), chi2_pvalue(c3, p3)) < 1e-6


def test_sampling_distribution_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = sampling_distribution(logits, DecodeParams(1.0, 0.8))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = sampling_distribution(logits, DecodeParams(1.0, 0.81))
    assert probs[2] > 0 and probs[3] == 0
