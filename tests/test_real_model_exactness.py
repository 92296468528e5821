"""The embedded default against Hugging Face itself, in the default test run: `default`'s greedy
output on the dtype's own weights equals ``model.generate`` on the real Gemma 3 270M (in the dtype
`default` runs in here), for a short prompt and for one longer than Gemma's 512-token sliding
window; and `default` on its own weights setting (``auto``: quantised kernels) equals plain
decoding (`baseline`) on the same weights.

Loads the real target (about 10 s from the converted cache; the first run on a machine converts
the GGUF first, about a minute)."""

from __future__ import annotations

import pytest
import torch

from conftest import interleaved

LONG = (
    "The history of the lighthouse at {n} Harbour Road begins in {y}, when the town council voted to "
    "replace the old signal fire with a stone tower. Builders hauled granite from the quarry on the "
    "hill, and the keeper kept a logbook of every ship, storm and repair. "
)


@pytest.fixture(scope="module")
def default_engine():
    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(1)
    return Engine.from_stack("gemma", overrides={"weights": "dtype"})


@pytest.fixture(scope="module")
def auto_engines():
    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(1)
    return Engine.from_stacks(["baseline", "gemma"])


def _hf_greedy(target, ids, n):
    out = target.model.generate(torch.tensor([ids], device=target.device), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


CASES = pytest.mark.parametrize("text,new", [("Explain why the sky is blue.", 32),
                                             ("".join(LONG.format(n=n, y=1700 + n) for n in range(14))
                                              + "\nSummarise this history in two sentences.", 16)],
                                 ids=["short", "beyond-sliding-window"])


@CASES
def test_default_equals_hugging_face_generate(default_engine, text, new):
    target = default_engine.target
    ids = target.tokenizer(target.format_prompt(text))["input_ids"]
    if new == 16:
        assert len(ids) > 512 + 50  # the window is crossed in the prompt and while decoding
    result = default_engine.generate(ids, max_new_tokens=new)
    assert result.token_ids == _hf_greedy(target, ids, new)
    assert result.stats.cycles < new  # speculation really ran (some drafts were accepted)


def test_against_unpatched_hugging_face_in_float32(default_engine):
    """The reference a user trusts: Hugging Face's own ``generate`` on the unpatched model in
    float32. ``default`` in float32 (patched kernels, split products) gives the same tokens; in the
    dtype it runs in here (bfloat16 on a CPU that computes it natively) it agrees for a prefix only,
    as any other bfloat16 run would; printed with ``-s``."""
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.targets import load_target

    reference = load_target("gemma3-270m").to(dtype=torch.float32)  # never patched: no engine built on it
    assert reference.batch_invariance is None
    ids = reference.tokenizer(reference.format_prompt("Explain why the sky is blue."))["input_ids"]
    expected = _hf_greedy(reference, ids, 32)
    f32 = Engine.from_stack("gemma", overrides={"weights": "dtype", "dtype": "float32"})
    assert f32.generate(ids, max_new_tokens=32).token_ids == expected
    ours = default_engine.generate(ids, max_new_tokens=32).token_ids
    common = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), len(expected))
    print(f"default in {default_engine.target.dtype}: {common} of 32 tokens equal to unpatched float32 Hugging Face")
    assert common >= 4  # a narrower dtype may part from float32's text, but not from its first words


@CASES
def test_default_on_its_weights_equals_plain_decoding_on_them(auto_engines, text, new):
    from dynaspec.runtime.q8 import available
    from dynaspec.runtime.quantized import fbgemm_available, weights_problem

    baseline, default = auto_engines
    assert baseline.target is default.target
    assert default.target.weights == ("w8a8" if weights_problem("w8a8") is None else "int8" if available() is None
                                      else "int8-head" if fbgemm_available() else "dtype")
    if default.target.weights == "w8a8":  # Gemma keeps its down projections (2,048 inputs) at 16 bits
        lean = {k: v for k, v in default.target.batch_invariance.items() if k.startswith("lean ")}
        assert lean["lean 640x2048 bfloat16"] == "stock (int8)"
        assert sum(v == "stock (w8a8)" for v in lean.values()) == len(lean) - 1
    ids = default.target.tokenizer(default.target.format_prompt(text))["input_ids"]
    result = default.generate(ids, max_new_tokens=new)
    assert result.stats.exactness == "guaranteed"
    assert result.token_ids == baseline.generate(ids, max_new_tokens=new).token_ids
    assert result.stats.cycles < new


def test_default_batched_with_other_requests_equals_it_alone(auto_engines):
    """Three requests generated together, as `dynaspec serve` does (their plain steps and
    verifications in shared passes of the real target on its quantised kernels): each output is its
    solo output."""
    _, default = auto_engines
    target = default.target
    texts = ["Explain why the sky is blue.", "def fibonacci(n):", "The capital of France is"]
    prompts = [target.tokenizer(target.format_prompt(t))["input_ids"] for t in texts[:1]] + \
        [target.tokenizer(t)["input_ids"] for t in texts[1:]]
    lengths = [32, 24, 16]
    out, sizes, _ = interleaved(default, prompts, lengths)
    widest = max(sizes)
    assert widest == 3
    assert out == [default.generate(p, max_new_tokens=n).text for p, n in zip(prompts, lengths)]


LOWERED = """
import json, sys, torch
torch.set_num_threads(2)
from dynaspec.runtime.engine import Engine
baseline, default = Engine.from_stacks(["baseline", "gemma"])
ids = default.target.tokenizer(default.target.format_prompt("Explain why the sky is blue."))["input_ids"]
spec = default.generate(ids, max_new_tokens=24)
json.dump({"capability": torch.backends.cpu.get_cpu_capability(), "exactness": spec.stats.exactness,
           "dtype": str(default.target.dtype),
           "spec": spec.token_ids, "plain": baseline.generate(ids, max_new_tokens=24).token_ids,
           "cycles": spec.stats.cycles}, sys.stdout)
"""


def test_default_is_exact_with_lowered_cpu_kernels_and_two_threads():
    """The kernels a user's machine runs can differ from the CPU's flags: torch limited to AVX2
    and oneDNN to AVX2, with 2 threads, probe their own verdicts (the verdict's key holds the
    capability, the ISA limit and the thread count) and the default stays its plain decoding."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", LOWERED], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["capability"] in ("AVX2", "DEFAULT")  # lowered (DEFAULT on a CPU without AVX2)
    assert out["dtype"] == "torch.float32"  # auto: bfloat16 would be emulated by these kernels
    assert out["exactness"] == "guaranteed" and out["spec"] == out["plain"]
    assert out["cycles"] < 24
