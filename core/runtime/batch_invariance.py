"""Batch-invariant target numerics: a verified row equals the plain step's row, bit for bit.

A verification runs the target over several drafted tokens at once, while plain decoding runs one
token per step. The math is the same, but a matrix kernel may pick another blocking of the inner
(K) dimension for another number of rows M, and rounding then differs in the last bit. In bfloat16
that bit is large enough to flip a greedy argmax now and then, so speculative output would drift
from plain decoding's (llama.cpp's speculative greedy output differs from its own plain output for
this reason).

:func:`make_batch_invariant` probes every distinct linear-layer shape of the target with the
target's own weights: it compares rows computed in batches of M against the same rows computed
one at a time. Where they differ, it tries splitting K into equal blocks whose products are
invariant, summing the blocks in float32 (one read of the weights, as before). A layer that no
split fixes is left as it is and reported: the engine's statistics and the benchmarks say whether
the target is batch-invariant, so a mismatch is never hidden.

The patched layers are used by every path alike (plain decoding, verification, ``model.generate``),
so the target's greedy output is one well-defined sequence.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: batch sizes probed: every count up to 16 (a chain of depth d verifies d + 1 rows; a server's
#: pass holds several requests' rows), then a few larger ones (trees up to about 60)
PROBE_ROWS = (*range(2, 17), 24, 32, 48, 64)
#: K-block counts tried, fewest first (each block is one more product call)
SPLITS = (2, 4, 8, 16, 32)
MIN_BLOCK = 4  # narrower K-blocks are not worth a product call each
BIG_WEIGHT = 1 << 24  # elements above which a weight is probed on fewer inputs


def _probe_weight(shape, like: torch.Tensor) -> torch.Tensor:
    """A weight of ``shape`` whose products expose the order of the inner sum: every row holds
    ones, plus +2**26 and -2**26 at two row-specific places. In float32 a 1 added while +-2**26 is
    pending is lost, so the result counts the ones summed outside that window: any change in how a
    kernel blocks or orders K shows up as a different integer, far above bfloat16's rounding."""
    n, k = shape
    w = torch.ones(n, k, dtype=torch.float32)
    rows = torch.arange(n)
    first = rows % k
    second = (rows * 7 + k // 2 + 1) % k
    second = torch.where(second == first, (first + 1) % k, second)
    w[rows, first] = 2.0 ** 26
    w[rows, second] = -(2.0 ** 26)
    return w.to(device=like.device, dtype=like.dtype)


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], k: int, like: torch.Tensor,
                    rows: tuple[int, ...]) -> bool:
    """Whether ``fn`` gives every row of an M-row batch exactly as it gives that row alone, for
    each M in ``rows``, on ones, random signs and random normal inputs."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    m = max(rows)
    inputs = [torch.ones(m, k), torch.randint(0, 2, (m, k), generator=gen).float() * 2 - 1,
              *(torch.randn(m, k, generator=gen) for _ in range(3))]
    if like.numel() > BIG_WEIGHT:  # an LM head: seconds per input; ones and one normal input
        inputs = [inputs[0], inputs[2]]
    for x in inputs:
        x = x.to(device=like.device, dtype=like.dtype)
        single = torch.cat([fn(x[i:i + 1]) for i in range(m)])
        if not all(torch.equal(fn(x[:r]), single[:r]) for r in rows):
            return False
    return True


def _split_linear(weight: torch.Tensor, bias: torch.Tensor | None, parts: int):
    """``F.linear`` computed as ``parts`` K-blocks summed in float32 (None if K does not divide)."""
    k = weight.shape[1]
    if k % parts:
        return None
    step = k // parts
    blocks: list[torch.Tensor] = []  # cut at the first call: a target computing through its lean
    # forward (or int8 weights) never calls its modules' products, and never pays for the copies

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not blocks:
            blocks.extend(weight[:, i * step:(i + 1) * step].contiguous() for i in range(parts))
        out = F.linear(x[..., :step], blocks[0]).float()
        for i in range(1, parts):
            out += F.linear(x[..., i * step:(i + 1) * step], blocks[i])
        if bias is not None:
            out += bias
        return out.to(x.dtype)

    return forward


def _padded_linear(weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int):
    """``F.linear`` over 2-D inputs, with fewer than ``min_rows`` rows zero-padded up to
    ``min_rows``. Where a kernel library computes one row (a matrix-vector product) and a few rows
    otherwise than many, but all counts from ``min_rows`` on alike, every row then gets the kernel
    of the many. A plain step pays a product of ``min_rows`` rows: the price of the guarantee where
    no K-split makes the stock kernel invariant."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= min_rows:
            return F.linear(x, weight, bias)
        padded = x.new_zeros(min_rows, x.shape[1])
        padded[:rows] = x
        return F.linear(padded, weight, bias)[:rows]

    return forward


#: row counts the padded fallback tries, fewest first
PAD_ROWS = (2, 4, 8, 16)

VERDICTS_FILE = "batch-invariance.json"


def verdicts_file() -> str:
    """Where verdicts are remembered: ``$DYNASPEC_VERDICTS_FILE`` where set (a path; the test suite
    points it at a temporary file, never the user's cache), else :data:`VERDICTS_FILE` in the cache
    root."""
    import os

    return os.environ.get("DYNASPEC_VERDICTS_FILE") or VERDICTS_FILE
PROBE_VERSION = 3  # bump when the probe or SPLITS change: remembered verdicts are then re-probed


def processor() -> tuple[str, str]:
    """The CPU's model name and a short hash of its feature flags (``/proc/cpuinfo``; where that is
    missing, ``platform.processor()`` and no flags)."""
    import hashlib
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1] for line in info.splitlines() if line.startswith("flags")), "")
    except OSError:
        model, flags = platform.processor(), ""
    return model, hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]


def _machine() -> str:
    """What decides which kernels run: torch's version and build, the processor or GPU, the CPU
    capability torch dispatches to and oneDNN's ISA limit (both can be lowered by environment
    variables), and the thread count (kernels block differently across threads)."""
    import hashlib
    import os
    import platform

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    model, flags = processor()
    build = hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:12]
    return "|".join([f"probe{PROBE_VERSION}", torch.__version__, build, platform.machine(), model, gpu, flags,
                     torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                     f"threads{torch.get_num_threads()}"])


def invariant_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                     rows: tuple[int, ...] = PROBE_ROWS, *, pad: bool = False) -> tuple[str, Callable | None]:
    """:func:`probe_linear`, remembered per machine (torch build, processor, GPU) in the cache
    root: the probe reads large products and costs seconds; its answer never changes there."""
    from dynaspec.runtime.cache import read_json, update_json

    key = "|".join([_machine(), "x".join(map(str, weight.shape)), str(weight.dtype), weight.device.type,
                    str(bias is not None), ",".join(map(str, rows)), "pad" if pad else "nopad"])
    verdict = read_json(verdicts_file()).get(key)
    if verdict is None:
        verdict = probe_linear(weight, bias, rows, pad=pad)[0]
        update_json(verdicts_file(), {key: verdict})
    if verdict.startswith("k-split"):
        return verdict, _split_linear(weight, bias, int(verdict.split()[1]))
    if verdict.startswith("pad"):
        return verdict, _padded_linear(weight, bias, int(verdict.split()[1]))
    return verdict, None


def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rows: tuple[int, ...] = PROBE_ROWS, *, pad: bool = False) -> tuple[str, Callable | None]:
    """How to compute ``F.linear(x, weight, bias)`` so that rows do not depend on the batch size:
    ``("stock", None)``, ``("k-split N", fn)``, with ``pad`` (for 2-D inputs) ``("pad N", fn)``
    (:func:`_padded_linear`), or ``("variant", None)`` if nothing tried works.
    Kernels are chosen by shape, dtype and device, never by value, so the probe runs on a weight
    of the same shape built to expose summation order (:func:`_probe_weight`)."""
    # the order-exposing weight catches a changed blocking of K; the real weight with random
    # inputs catches changed rounding of the products (fused multiply-adds in float32)
    weights = [(_probe_weight(tuple(weight.shape), weight), None if bias is None else torch.ones_like(bias)),
               (weight, bias)]
    k = weight.shape[1]
    with torch.inference_mode():
        if all(_rows_invariant(lambda x, w=w, b=b: F.linear(x, w, b), k, weight, rows) for w, b in weights):
            return "stock", None
        for parts in SPLITS:
            if k % parts or k // parts < MIN_BLOCK:
                continue
            if all(_rows_invariant(_split_linear(w, b, parts), k, weight, rows) for w, b in weights):
                return f"k-split {parts}", _split_linear(weight, bias, parts)
        for min_rows in PAD_ROWS if pad else ():
            if all(_rows_invariant(_padded_linear(w, b, min_rows), k, weight, rows) for w, b in weights):
                return f"pad {min_rows}", _padded_linear(weight, bias, min_rows)
    return "variant", None


def make_batch_invariant(module: nn.Module, rows: tuple[int, ...] = PROBE_ROWS) -> dict[str, str]:
    """Patch every ``nn.Linear`` of ``module`` whose kernel is not batch-invariant (see the module
    docstring). Returns, per distinct shape, what was found: ``stock``, ``k-split N`` or
    ``variant``. The probe runs once per shape (a few ms for a 270M model's layers)."""
    verdicts: dict[tuple, str] = {}
    for layer in module.modules():
        if not isinstance(layer, nn.Linear):
            continue
        w = layer.weight
        key = (tuple(w.shape), str(w.dtype), str(w.device), layer.bias is not None)
        if key not in verdicts:
            verdicts[key] = invariant_linear(w, layer.bias, rows)[0]
        if verdicts[key].startswith("k-split") and "forward" not in vars(layer):
            # captures this dtype and device's weights: patch after the final cast and move
            layer.forward = _split_linear(w, layer.bias, int(verdicts[key].split()[1]))
    return {f"{k[0][0]}x{k[0][1]} {k[1].removeprefix('torch.')}": v for k, v in verdicts.items()}


# -- attention ----------------------------------------------------------------------------------
# Attention over one query row is not computed alike for one row and for several: Hugging Face's
# SDPA path packs the query heads of a single row (grouped-query attention) and the kernel blocks
# the keys by their count, which differs between a plain step (the keys up to the token) and a
# verification (the keys up to the last drafted token, later ones masked). For a chain, row i of
# a verification sees exactly the keys a plain step at that position sees, so computing it as that
# step would (one row, the key prefix up to it) reproduces the plain step bit for bit.

_ROWWISE: contextvars.ContextVar[bool] = contextvars.ContextVar("dynaspec_rowwise", default=False)
ROWWISE_ATTENTION = "dynaspec_rowwise_sdpa"


def _rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = query.shape[2]
    if rows == 1 or not _ROWWISE.get():
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    keys = key.shape[2]
    out = []
    for i in range(rows):
        end = keys - rows + i + 1  # row i sees the keys up to its own position (a chain)
        mask = None if attention_mask is None else attention_mask[:, :, i:i + 1, :end].contiguous()
        out.append(sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :end], value[:, :, :end],
                                          mask, **kwargs)[0])
    return torch.cat(out, dim=1), None


def install_rowwise_attention(model: nn.Module) -> bool:
    """Route ``model``'s SDPA attention through :func:`_rowwise_sdpa` (identical unless
    :func:`rowwise_chain` is active). Returns False for other attention implementations."""
    from transformers import AttentionInterface

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == ROWWISE_ATTENTION:
        return True
    if current != "sdpa":
        return False
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_sdpa)
    # masks as for SDPA when Hugging Face builds them (e.g. in ``model.generate``); without this
    # entry a custom implementation gets no mask at all, no causal or sliding window
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROWWISE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(ROWWISE_ATTENTION)
    return True


@contextlib.contextmanager
def rowwise_chain(active: bool = True):
    """Within this block, multi-row attention of a patched model computes each row as a plain
    step would; the rows must form a chain (row i follows row i - 1)."""
    token = _ROWWISE.set(active)
    try:
        yield
    finally:
        _ROWWISE.reset(token)
