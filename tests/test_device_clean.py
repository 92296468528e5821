"""Every tensor the engine and its components create lives on the target's device.

With the default device set to ``meta``, a tensor made without an explicit ``device=`` lands on
the meta device, and the first operation that mixes it with the CPU target's tensors fails (or the
output stops being real tokens). A generation that still matches the target's greedy output proves
that nothing in the loop relied on the default device, which is what running on CUDA needs."""

from __future__ import annotations

import pytest
import torch

from conftest import builtin_registry, make_engine, reference_greedy, target, trained_drafter

STACKS = {
    "plain": {"drafter": None},
    "chain": {"draft": {"mode": "chain", "depth": 4, "min_confidence": 0.05}},
    "tree": {"draft": {"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10}},
    "frequency-blocked": {"draft": {"mode": "chain", "depth": 3}, "backend": "torch-blocked",
                          "shortlister": {"name": "frequency", "context": 16},
                          "scheduler": {"name": "fixed", "budget": 64}},
}


@pytest.fixture
def frequency_list(tmp_path):
    from dynaspec.shortlisters.frequency import save_frequency

    tgt = target("llama")
    save_frequency(tmp_path, torch.arange(tgt.vocab_size, 0, -1), {"target": tgt.fingerprint()})
    return str(tmp_path)


def test_meta_default_device_catches_a_stray_tensor():
    """The check itself works: a tensor made without a device does not mix with CPU tensors."""
    cpu = torch.ones(3)
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        (cpu + torch.tensor([1.0, 2.0, 3.0])).tolist()


@pytest.mark.parametrize("name", list(STACKS))
def test_generation_creates_no_tensor_off_the_target_device(name, frequency_list):
    fields = dict(STACKS[name])
    if "shortlister" in fields:
        fields["shortlister"] = {**fields["shortlister"], "path": frequency_list}
    drafter = trained_drafter("llama") if fields.pop("drafter", "x") is not None else None
    prompt = [5, 17, 42, 8, 63]
    with torch.device("meta"):  # assembly too: components must place what they build
        engine = make_engine("llama", drafter, builtin_registry(), **fields)
        result = engine.generate(prompt, max_new_tokens=24)
    assert result.token_ids == reference_greedy("llama", prompt, 24)


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_sampling_creates_no_tensor_off_the_target_device(name):
    drafter = trained_drafter("llama")
    with torch.device("meta"):
        engine = make_engine("llama", drafter, builtin_registry(), **STACKS[name])
        result = engine.generate([5, 17, 42], max_new_tokens=16, temperature=0.8, seed=3)
    assert len(result.token_ids) == 16 and all(0 <= t < 128 for t in result.token_ids)
