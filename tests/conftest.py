"""Shared fixtures: fresh registries with autoloading off, tiny random targets, trained drafters."""

from __future__ import annotations

import functools
import os
import tempfile

# Triton reads TRITON_INTERPRET when it is imported: on a machine without a GPU its kernels can
# only run under the interpreter, so set it before anything imports triton. With a CUDA GPU they
# compile for it (tests/test_cuda.py); DYNASPEC_TRITON_ON_GPU=1 asks for that explicitly.
# (Importing torch does not import triton.)
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("DYNASPEC_TRITON_ON_GPU")
                      or __import__("torch").cuda.is_available() else "1")
# targets load in full, their Hugging Face model at hand (tests/test_image.py turns images on)
os.environ.setdefault("DYNASPEC_IMAGES", "0")
# the numerics probe's verdicts go to a file of this test run, never into the user's cache
os.environ.setdefault("DYNASPEC_VERDICTS_FILE",
                      os.path.join(tempfile.mkdtemp(prefix="dynaspec-verdicts-"), "batch-invariance.json"))

import pytest  # noqa: E402
import torch  # noqa: E402

from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.drafter import Drafter, DrafterConfig
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.registry import Registry
from dynaspec.training.quick import greedy_sequences, train_drafter

# tiny models gain nothing from threads, and threads suffer badly on a shared 2-core machine
torch.set_num_threads(1)

def _builtin_modules() -> tuple:
    """The built-in plugin modules, as declared once: the package's own entry points."""
    import importlib
    import importlib.metadata

    eps = [ep for ep in importlib.metadata.entry_points(group="dynaspec")
           if ep.dist is not None and ep.dist.metadata["Name"] == "dynaspec"]
    return tuple(importlib.import_module(ep.value) for ep in sorted(eps, key=lambda e: e.name))


BUILTIN_MODULES = _builtin_modules()


def builtin_registry(*extra) -> Registry:
    """A fresh registry with the built-ins (as distribution 'dynaspec') and ``extra`` plugins."""
    registry = Registry.create(entry_points=False)
    for module in BUILTIN_MODULES:
        registry.add_plugin(module, name=module.__name__, distribution="dynaspec", version="test")
    for plugin in extra:
        registry.add_plugin(plugin)
    return registry


@pytest.fixture
def registry() -> Registry:
    return builtin_registry()


@functools.lru_cache(maxsize=None)
def target(kind: str):
    return tiny_target(kind)


@functools.lru_cache(maxsize=None)
def trained_drafter(kind: str) -> Drafter:
    """A drafter trained for a few seconds on the tiny target's own greedy text."""
    tgt = target(kind)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 99, (6,), generator=gen).tolist() for _ in range(24)]
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.like_target(tgt.model),
                      meta={"target": tgt.fingerprint()})
    train_drafter(drafter, tgt, greedy_sequences(tgt, prompts, 48), steps=300)
    return drafter


def random_drafter(kind: str, seed: int = 1) -> Drafter:
    torch.manual_seed(seed)
    tgt = target(kind)
    return Drafter(DrafterConfig.like_target(tgt.model), meta={"target": tgt.fingerprint()}).eval()


#: The draft-head backend the engine tests run with (nox runs the suite once per backend).
BACKEND = os.environ.get("DYNASPEC_TEST_BACKEND", "torch")


def make_engine(kind: str, drafter: Drafter | None, registry: Registry, **fields) -> Engine:
    data = {"name": "test", "target": f"tiny-{kind}", "drafter": "in-memory" if drafter else None,
            "backend": BACKEND}
    data.update(fields)
    return Engine(stack_from_mapping(data), target(kind), drafter, registry=registry)


def reference_greedy(kind: str, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding through Hugging Face ``generate``."""
    out = target(kind).model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def tiny_spec_stack(tmp_path, monkeypatch):
    """A speculative stack file on the tiny Llama target (trained drafter saved as an artifact),
    with the name ``baseline`` resolving to that target's plain decoding for this test."""
    from dynaspec.runtime import stacks as stacks_mod

    trained_drafter("llama").save(tmp_path / "drafter")
    spec = tmp_path / "spec.toml"
    # float32: the tests that use it compare it with stacks in other dtypes (auto would be
    # bfloat16 where the CPU computes it natively)
    spec.write_text(f'name = "spec"\ntarget = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\ndtype = "float32"\n'
                    '[draft]\nmode = "tree"\ndepth = 3\ntopk = 2\ntotal_tokens = 6\n')
    base = tmp_path / "baseline.toml"
    base.write_text('name = "baseline"\ntarget = "tiny-llama"\ndrafter = "none"\n')
    real = stacks_mod.resolve_stack
    monkeypatch.setattr(stacks_mod, "resolve_stack",
                        lambda ref, **kw: real(str(base) if ref == "baseline" else ref, **kw))
    return spec


# -- the int8 kernel's reference (dynaspec.runtime.q8): what its C quantisation and packing compute --
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``weight`` as int8 in [-127, 127] times its float32 scale (its
    largest magnitude over 127; rows of zeros get scale 1)."""
    w = weight.detach().float()
    amax = torch.linalg.vector_norm(w, float("inf"), dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_rows_reference(hidden: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, u8: bool) -> torch.Tensor:
    """What ``q8.Int8Rows.logits`` computes for ``hidden`` [M, K] over the int8 rows ``q`` [R, K]
    with their ``scale`` [R]: with 8-bit activations (``u8``), each row of ``hidden`` quantised as a
    weight row is, the exact integer sums, then ``(sum * sx) * scale`` in float32 (bit for bit);
    else the float32 product of ``hidden`` and the dequantised rows (to float32's rounding)."""
    x = hidden.float()
    if not u8:
        return x @ (q.float() * scale[:, None]).T
    xq, sx = quantize_rows(x)
    sums = (xq.long() @ q.long().T).float()  # exact: |sum| < 2^24 for the sizes tested
    return (sums * sx[:, None]) * scale[None, :]


def pack_tiles(q: torch.Tensor, lanes: int, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, tail)``: int8 weights ``q`` [N, K] in the kernel's layout. For each tile of
    ``tile_rows`` rows (the last padded with zero rows), its first ``K - K % lanes`` columns as
    [K / lanes, tile_rows, lanes]; the last ``K % lanes`` columns of every row apart, [N, K % lanes]."""
    n, k = q.shape
    kv = k - k % lanes
    tiles = -(-n // tile_rows)
    body = q.new_zeros(tiles * tile_rows, kv)
    body[:n] = q[:, :kv]
    packed = body.view(tiles, tile_rows, kv // lanes, lanes).transpose(1, 2).contiguous().view(-1)
    return packed, q[:, kv:].contiguous()


def alone_and_together(tgt, passes) -> tuple[list, list]:
    """Two sets of the same target passes (``passes()`` makes one): the first run one by one, the
    second in one ``forward_many``, whose rows must be the first's bit for bit."""
    alone = passes()
    for p in alone:
        tgt.forward_many([p])
    together = passes()
    tgt.forward_many(together)
    return alone, together


def interleaved(engine: Engine, prompts, lengths, *, controls=None, limits=None,
                **kwargs) -> tuple[list[str], list[int], list]:
    """Generate every prompt at once, as the server's worker does: each cycle, every active
    generation runs to its next target pass, and all the passes run in one ``forward_many``.
    ``controls``: each generation's :class:`DepthControl`; ``limits(cycle, i)``: the draft limit
    generation ``i`` gets before it drafts in that cycle (every pass is checked against it)."""
    from dynaspec.runtime.stats import GenerationStats
    from dynaspec.runtime.target import TargetPass

    stats = [GenerationStats() for _ in prompts]
    controls = controls or [None] * len(prompts)
    gens = [engine.stream_passes(p, max_new_tokens=n, stats=s, control=c, **kwargs)
            for p, n, s, c in zip(prompts, lengths, stats, controls)]
    texts = [""] * len(prompts)
    active, sizes = list(range(len(prompts))), []
    while active:
        passes = []
        for i in list(active):
            if limits is not None:
                controls[i].limit = limits(len(sizes), i)
            for item in gens[i]:
                if isinstance(item, TargetPass):
                    if limits is not None and controls[i].limit is not None:
                        assert len(item.ids) <= controls[i].limit + 1
                    passes.append(item)
                    break
                texts[i] += item
            else:
                active.remove(i)
        engine.target.forward_many(passes, strict=engine.strict)
        sizes.append(len(passes))
    return texts, sizes, stats
