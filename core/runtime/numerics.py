"""The target's numerics, owned in one place: the dtype a stack runs in, the kernel of each product
the target computes (the body's linears, the lean forward's fused products, the LM head in every
dtype and weights setting, attention over a chain's rows), the probe that makes each of them
batch-invariant, and the verdict on exactness that the engine enforces and reports.

Why it matters: a verification computes a chain's rows together, plain decoding one row a step.
Greedy speculative output equals plain decoding only if every product rounds a row alike whatever
number of rows it is computed with, and matrix libraries do not promise that (their kernels block
and split the reduction by the row count). So, for the machine at hand:

* :func:`resolve_dtype`: ``dtype = "auto"`` is bfloat16 only where the kernels that will run compute
  it natively (the CPU's flags, torch's dispatch capability and oneDNN's ISA limit), else float32;
* :func:`probe`: every product is probed at every row count one pass can hold
  (:mod:`dynaspec.runtime.batch_invariance` for the dtype kernels, :mod:`dynaspec.runtime.quantized`
  for the quantised ones) and gets the kernel that is invariant: the stock one, a K-split, or
  padding to the fewest rows whose kernel every larger count shares. Verdicts are remembered per
  torch build, processor, CPU capability, oneDNN ISA limit and thread count;
* :func:`set_up`: what every :class:`~dynaspec.runtime.engine.Engine` runs on its target before
  anything else (the weights setting, then the probe), whoever loaded the target;
* :func:`verdict`: ``guaranteed`` or ``not guaranteed``, and why; an ``exact = "required"`` stack
  refuses to run without the guarantee.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from dynaspec.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: row counts the LM head is probed at: every verification of a chain up to depth 8
HEAD_PROBE_ROWS = tuple(range(2, 10))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; none where it is missing)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return set(next((line for line in fh if line.startswith("flags")), "").split())
    except OSError:
        return set()


#: oneDNN ISA limits (``ONEDNN_MAX_CPU_ISA``) under which its products compute bfloat16 natively
_ONEDNN_BF16_ISAS = {"AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT", ""}


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 natively with the kernels that will run (then it is the
    faster target dtype): on a CPU, the processor has the instructions (``/proc/cpuinfo``), torch
    dispatches to its AVX-512 kernels (``ATEN_CPU_CAPABILITY`` can lower that) and oneDNN may use
    them (``ONEDNN_MAX_CPU_ISA`` can lower that). Emulated bfloat16 costs more than float32 and
    makes a verification's rows far dearer than a plain step's."""

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_flags()
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_BF16_ISAS


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """A ``dtype`` setting as a torch dtype. ``auto`` is bfloat16 where the device computes it
    natively (chains and, on the lean forward, trees verify bit for bit there), else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported: one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def certificate(target, verdict: str) -> float | None:
    """The factor of ``|h|`` above which a one-row head product's top-2 margin certifies its argmax
    as the padded product's (:meth:`TargetModel.greedy_token`), or None where that does not apply:
    a head that does not pad, a dtype other than float32 (or float32 products allowed to round
    through a narrower type), a bias or a soft-cap (whose saturation can tie logits)."""

    if (not verdict.startswith("pad") or target.dtype != torch.float32 or target.lm_head_bias is not None
            or target.softcap or torch.get_float32_matmul_precision() != "highest"
            or os.environ.get("MKL_BLAS_COMPUTE_MODE")):
        return None
    k = target.lm_head_weight.shape[1]
    unit = 2.0 ** -24
    gamma = k * unit / (1 - k * unit)
    largest = float(target.lm_head_weight.double().norm(dim=1).max())
    # two kernels differ by at most 2 gamma (|w_top| + |w_j|) |h| <= 4 gamma max|w| |h|; twice that
    # again as a margin for the norms' own rounding
    return 8 * gamma * largest


def stack_dtype(stack) -> torch.dtype:
    """The dtype a :class:`~dynaspec.runtime.config.StackConfig` runs its target in."""
    return resolve_dtype(stack.dtype, stack.device)


def probe(target) -> dict[str, str]:
    """Give every product of ``target`` its batch-invariant kernel and return the verdict per
    product (kept as ``target.batch_invariance``); runs once per target, after its final dtype,
    device and weights setting. Where no K-split helps, the lean forward's products and its LM head
    pad plain steps to the fewest rows whose kernel every larger row count shares (exact, but a
    plain step then costs a product of several rows); the Hugging Face modules' products stay
    ``variant`` there. These are the *strict* kernels; the *relaxed* ones (``strict=False``, for
    stacks with ``exact = "observed"``) are the same but the stock kernel where the strict one pads.
    With quantised weights the lean forward and the head use those kernels, probed the same way
    (:func:`dynaspec.runtime.quantized.quantized_linear`)."""
    if target.batch_invariance is None:
        from dynaspec.runtime import quantized
        from dynaspec.runtime.batch_invariance import (
            install_rowwise_attention,
            invariant_linear,
            make_batch_invariant,
        )
        from dynaspec.runtime.quantized import quantized_linear

        lean = target.forward_kind == "lean"
        body_kind = {"dtype": None, "float16": "float16", "int8-head": "float16", "int8": "int8",
                     "w8a8": "w8a8"}[target.weights]
        head_kind = {"dtype": None, "float16": "float16", "int8-head": "int8-dynamic", "int8": "int8",
                     "w8a8": "w8a8"}[target.weights]
        if head_kind == "w8a8" and "lm_head" in target.w8a8_int16:
            head_kind = "int8"
        # the Hugging Face modules' products (none for a target restored from an image)
        report = make_batch_invariant(target.decoder) if target.model is not None else {}
        head_name = "lm_head " + "x".join(map(str, target.lm_head_weight.shape))
        if head_kind is None:
            verdict, head = invariant_linear(target.lm_head_weight, target.lm_head_bias, rows=HEAD_PROBE_ROWS,
                                             pad=lean)
            # the probed kernel, also where it is stock: the float32 head otherwise takes the tall
            # product for several rows, a kernel of its own that the probe did not see
            target._head = head if head is not None or verdict != "stock" else functools.partial(
                F.linear, weight=target.lm_head_weight, bias=target.lm_head_bias)
            target._relaxed_head = None if verdict.startswith("pad") else target._head
            target._certify = certificate(target, verdict)
        else:
            # the quantised kernels' probe covers every row count up to its most (64): trees of up
            # to 63 drafted tokens, and a batched pass of several requests' rows up to 64, share
            # one head product under the guarantee
            verdict, target._head, target._relaxed_head = quantized_linear(
                head_kind, target.packed_head or target.lm_head_weight, target.lm_head_bias,
                rows=quantized.PROBE_ROWS)
            target.max_head_rows = quantized.PROBE_ROWS
            target._certify = None
        report[head_name] = verdict
        target._rowwise = install_rowwise_attention(target.model) if target.model is not None else False
        report["attention"] = "row-wise for chains" if target._rowwise else "variant"
        if lean:
            # the lean forward's fused products have shapes of their own: probed as well; it
            # attends a chain row by row by construction
            from dynaspec.runtime.lean import stock_linear

            def linear(weight, bias, name=""):
                shape = "x".join(map(str, weight.shape)) + " " + str(weight.dtype).removeprefix("torch.")
                if body_kind is not None:
                    kind = "int8" if body_kind == "w8a8" and name in target.w8a8_int16 else body_kind
                    verdict, strict, relaxed = quantized_linear(kind, weight, bias)
                    report[f"lean {shape}"] = verdict
                    return strict, relaxed, relaxed
                verdict, fn = invariant_linear(weight, bias, pad=True)
                report[f"lean {shape}"] = verdict
                stock = stock_linear(weight, bias)
                return fn or stock, stock if verdict.startswith("pad") else fn or stock, stock

            target._lean = target._build_lean(linear, compiled=target.weights in ("int8", "w8a8"))
            report["attention"] = ("row-wise for chains and trees" + (", compiled kernel"
                                                                        if target._lean._c_attend is not None else ""))
        from dynaspec.runtime import batch_invariance

        # the rows one pass of several sequences computes: what the probe of its kernels covered
        # (the quantised kernels' probe: every count up to its most; the others': the counts listed)
        target.max_pass_rows = quantized.PROBE_ROWS if body_kind is not None else max(batch_invariance.PROBE_ROWS)
        target.pass_rows = None if body_kind is not None else frozenset((1, *batch_invariance.PROBE_ROWS))
        # every row count from 1 to this one is probed for the body and the head: the longest chain
        # (plus its root) a verification can hold under the guarantee
        body_rows = target.max_pass_rows if body_kind is not None else _contiguous(batch_invariance.PROBE_ROWS)
        target.probed_rows = min(body_rows, target.max_head_rows if head_kind is not None
                                 else _contiguous(HEAD_PROBE_ROWS))
        target.batch_invariance = report
    return target.batch_invariance


def cheap_rows(target) -> bool:
    """Whether ``target``, set up, verifies a draft tree's rows (up to 16) for about the cost of one
    row: its lean forward on the quantised kernel with 8-bit activations on AMX tiles (a pass of 8
    rows then costs 1.18 one-row passes, against 1.57 on AVX-512 VNNI; docs/results.md, session 35;
    docs/history.md, session 31).
    What ``draft.mode = "auto"`` drafts a tree on."""
    if getattr(target, "forward_kind", None) != "lean" or getattr(target, "weights", None) != "w8a8":
        return False
    if "lm_head" in getattr(target, "w8a8_int16", ()):
        return False
    from dynaspec.runtime import q8

    return q8.available(target.device) is None and q8.amx()


def set_up(target, stack) -> None:
    """The numerics of ``target`` for ``stack``: its weights setting, then the probe (once per
    target). A target already probed must have the stack's weights."""
    from dynaspec.runtime.quantized import resolve_weights

    weights = resolve_weights(stack.weights, target.device, target.auto_weights)
    if target.batch_invariance is None:
        target.use_weights(weights)
    elif target.weights != weights:
        raise ConfigError(f"stack '{stack.name}' computes its target from weights = \"{weights}\", but the "
                          f"target given uses \"{target.weights}\": load one target per weights setting")
    probe(target)


def verdict(target, source, *, strict: bool) -> tuple[str, str]:
    """``("guaranteed" | "not guaranteed", reason)`` for greedy output equal to plain decoding (and,
    sampling, the target's own distribution) with ``target`` probed on this machine and the drafts
    of ``source`` (None: plain decoding); ``strict``: the strict (padded) kernels run."""
    if source is None:
        return "guaranteed", "plain decoding"
    tree = not source.chains_only
    if tree and getattr(target, "forward_kind", None) != "lean":
        return "not guaranteed", ("a tree's rows attend to scattered ancestors, which the generic forward "
                                  "does not lay out as a plain step does (the lean forward does)")
    drafted, shape, field = ((source.max_tokens, "a tree of up to", "total_tokens") if tree
                             else (source.max_depth, "a chain of", "depth"))
    if drafted + 1 > target.probed_rows:
        return "not guaranteed", (f"{shape} {drafted} drafted tokens verifies {drafted + 1} rows, and the "
                                  f"probe covers 1 to {target.probed_rows}: draft.{field} <= {target.probed_rows - 1}")
    variant = target.variant_products(strict=strict)
    dtype = str(target.dtype).removeprefix("torch.")
    if variant:
        return "not guaranteed", (f"in {dtype} on this machine the rows of {', '.join(variant)} depend on how "
                                  "many are computed together")
    kinds = sorted({v for k, v in target.products_in_use().items() if k != "attention"})
    return "guaranteed", (f"every product probed batch-invariant in {dtype} on this machine ({', '.join(kinds)}); "
                          + ("a tree's rows attend each over its own line, as the plain step after it"
                             if tree else "chains attend row by row"))


def _contiguous(rows) -> int:
    """The largest n such that every count from 1 to n is among ``rows`` (1 always is)."""
    rows, n = set(rows), 1
    while n + 1 in rows:
        n += 1
    return n
