"""The target's weights in fewer bytes on a CPU: float16 and int8 products.

On a CPU a plain step of a small target reads every weight once, so its cost follows the bytes of
its weights. Float32 weights read 4 bytes each, bfloat16 2. This module gives the lean forward and
the LM head products that read 2 bytes per weight (``float16``) or 1 (the int8 kinds):

- **float16** (FBGEMM's ``linear_dynamic_fp16``, shipped in PyTorch's x86 builds): weights stored
  as float16, activations and sums in float32. Weight-only: on held text the target's
  log-likelihood moves by about 0.01%.
- **int8** (:mod:`dynaspec.runtime.q8`, this project's kernel, compiled at first use): weights as
  int8 with one scale per output row; activations in float32 (FMAs), or, where the processor has
  AVX-512 VNNI, each activation row as int16 with a scale of its own (integer dot products, about
  half the cost for a verification's rows). Batch-invariant by construction. The weights setting
  ``int8`` computes the whole target with it.
- **w8a8** (the same kernel): each activation row as int8 with a scale of its own too, multiplied
  by AVX-512 VNNI's u8 x s8 dot products (64 an instruction, no widening): the cheapest products
  for a verification's rows, at a quality cost that docs/results.md measures. Batch-invariant by
  construction (integer sums).
- **int8-dynamic** (FBGEMM's ``linear_dynamic``): weights as int8 with one scale per output row;
  each activation row as 7-bit integers with one scale of its own; sums in int32.

  A dynamic int8 product quantises its input with one scale for the whole input, so a row's result
  would depend on the other rows beside it. Here each row is first divided by its own largest
  magnitude, and two constant columns (+1 and -1, against zero weights) are appended: every input
  then spans exactly [-1, 1], the kernel's scale is the same for any batch, and the row is
  multiplied back afterwards. Integer sums are exact in any order, and the rest is elementwise: a
  row's result does not depend on how many rows are computed with it, by construction.
  Activations at 7 bits per row cost more than the weights' rounding: on the LM head alone the
  log-likelihood of held text moves by about 0.5% (docs/results.md), in the body several percent,
  so it is offered for the head only (``int8-head``: float16 body, int8-dynamic head).

FBGEMM's kernels cost nearly the same from one row to the six or so of a verification (the weight
tile is read once for all rows), unlike a float32 product on a CPU without AVX-512, which costs
two to three times as much for four rows as for one.

**Batch invariance.** Float16 products round the same for most row counts but not all (on an AVX2
CPU, one and two rows differ from three, seven from eight). :func:`probe_quantized` finds, for a
kernel and a weight, the row counts whose rows equal those of a reference block, and
:func:`padded` pads every other count up to the next good one. Verdicts are remembered per machine
like the float ones (:func:`dynaspec.runtime.batch_invariance.invariant_linear`).
"""

from __future__ import annotations

import abc
import functools
import warnings
from typing import Callable

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import WEIGHTS_CHOICES  # see StackConfig.weights

#: row counts probed for a kernel: a chain up to depth 63 verifies at most 64 rows, and a batched
#: pass of several requests shares one product for up to 64 rows
PROBE_ROWS = 64
PROBE_VERSION = 3  # bump when a kernel or the probe changes: remembered verdicts are re-probed

Linear = Callable[[torch.Tensor], torch.Tensor]


def fbgemm_available(device: torch.device | str = "cpu") -> bool:
    """Whether this torch build has FBGEMM's kernels for ``device`` (x86 CPUs)."""
    return torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


def weights_problem(name: str, device: torch.device | str = "cpu") -> str | None:
    """Why the weights setting ``name`` cannot run on ``device`` (None: it can)."""
    if name == "dtype":
        return None
    if name in ("int8", "w8a8"):
        from dynaspec.runtime.q8 import available, modes

        problem = available(device)
        if problem is None and name == "w8a8" and "int8" not in modes():
            problem = "8-bit activations need AVX-512 VNNI, which this processor (or DYNASPEC_Q8_ISA) lacks"
        return problem
    if not fbgemm_available(device):
        return f"FBGEMM's CPU kernels, which this torch build or device ({torch.device(device)}) lacks"
    return None


def resolve_weights(name: str, device: torch.device | str = "cpu", measured: str = "dtype") -> str:
    """A ``weights`` setting as the kind used. ``auto`` is ``measured`` (the target's
    ``auto_weights``: the fastest setting whose quality was measured within bounds for that target,
    ``dtype`` for a target nobody measured) where it can run; else (``w8a8`` without AVX-512 VNNI)
    ``int8`` where the int8 kernel builds, else ``int8-head`` where FBGEMM's kernels exist (the
    int8 kernel needs a C compiler), else ``dtype``. Other settings are checked against the device."""
    if name not in WEIGHTS_CHOICES:
        raise ConfigError(f"weights {name!r} is not supported: one of {', '.join(WEIGHTS_CHOICES)}")
    if name == "auto":
        fallbacks = ("int8", "int8-head", "dtype") if measured == "w8a8" else ("int8-head", "dtype")
        for choice in (measured, *fallbacks):
            if weights_problem(choice, device) is None:
                return choice
    problem = weights_problem(name, device)
    if name in ("int8", "w8a8") and problem is not None:
        raise ConfigError(f"weights = \"{name}\" needs its kernel, which cannot run here: {problem}; "
                          "use weights = \"int8\", \"int8-head\" or \"dtype\"")
    if problem is not None:
        raise ConfigError(f"weights = \"{name}\" needs FBGEMM's CPU kernels, which this torch build or device "
                          f"({torch.device(device)}) lacks: use weights = \"dtype\"")
    return name


#: output rows packed per FBGEMM matrix: packing one 262,144-row LM head takes about twice as long
#: as packing it in blocks of this many rows, and a product over the blocks costs the same
PACK_ROWS = 32768


def _blocks(weight: torch.Tensor) -> list[torch.Tensor]:
    return [weight[i:i + PACK_ROWS] for i in range(0, weight.shape[0], PACK_ROWS)]


class _Packed(abc.ABC):
    """A product over FBGEMM-packed row blocks of one weight (see :data:`PACK_ROWS`)."""

    kind = ""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode():
            self.packed = [self._pack(block.detach().float()) for block in _blocks(weight)]
        self.bias = None if bias is None else bias.detach().float()

    @abc.abstractmethod
    def _pack(self, block: torch.Tensor):
        """One float32 block of the weight in the kernel's packed form."""

    @abc.abstractmethod
    def _product(self, rows: torch.Tensor, packed) -> torch.Tensor:
        """The kernel's product of 2-D float32 ``rows`` with one packed block."""

    def _products(self, rows: torch.Tensor) -> torch.Tensor:
        if len(self.packed) == 1:
            return self._product(rows, self.packed[0])
        return torch.cat([self._product(rows, packed) for packed in self.packed], dim=1)


class Float16Linear(_Packed):
    """``F.linear`` with the weight stored as float16 (FBGEMM's packed layout), for inputs of any
    float dtype (computed in float32, returned in the input's dtype)."""

    kind = "float16"

    def _pack(self, block):
        return torch.ops.quantized.linear_prepack_fp16(block.contiguous(), None)

    def _product(self, rows, packed):
        return torch.ops.quantized.linear_dynamic_fp16(rows, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._products(x.reshape(-1, shape[-1]).float())
        if self.bias is not None:
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


class Int8Linear(_Packed):
    """``F.linear`` with int8 weights (one scale per output row) and each input row quantised to
    7 bits with a scale of its own, batch-invariant by construction (see the module docstring)."""

    kind = "int8-dynamic"
    _ends = torch.tensor([[1.0, -1.0]])

    def _pack(self, block):
        scales = (torch.linalg.vector_norm(block, float("inf"), dim=1) / 127).clamp_min(1e-12).double()
        # two zero columns meet the constant +1 and -1 columns appended to every input row
        padded = torch.cat([block, block.new_zeros(block.shape[0], 2)], dim=1)
        with warnings.catch_warnings():  # quantised tensors are only the packing's input here
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(padded, scales, torch.zeros(block.shape[0], dtype=torch.long), 0,
                                           torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)

    def _product(self, rows, packed):
        # reduce_range: 7-bit activations, so that AVX2's 16-bit pair sums never saturate
        return torch.ops.quantized.linear_dynamic(rows, packed, True)

    def quantised_weight(self) -> torch.Tensor:
        """The weight as the kernel sees it, dequantised (float32): for quality checks."""
        return torch.cat([torch.ops.quantized.linear_unpack(p)[0].dequantize()[:, :self.in_features]
                          for p in self.packed])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        y = self._products(torch.cat([rows / scale, self._ends.expand(rows.shape[0], 2)], dim=1))
        y *= scale
        if self.bias is not None:
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


class PackedWeight:
    """A product's weight already packed for the kernel of ``kind`` (restored from an image, see
    :mod:`dynaspec.runtime.image`): what the linear factories get instead of the weight tensor.
    ``shape`` and ``dtype`` are the weight's as the target holds it."""

    def __init__(self, kind: str, kernel, dtype: torch.dtype) -> None:
        self.kind = kind
        self.kernel = kernel
        self.shape = torch.Size((kernel.out_features, kernel.in_features))
        self.dtype = dtype


def make_kernel(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The product of ``weight`` in ``kind``: "float16", "int8-dynamic" (FBGEMM, 7-bit
    activations), "int8" (weight-only, :mod:`dynaspec.runtime.q8`, activations in the weight's
    dtype) or "w8a8" (the same kernel, each activation row as int8)."""
    if kind == "float16":
        return Float16Linear(weight, bias)
    if kind == "int8-dynamic":
        return Int8Linear(weight, bias)
    if kind == "int8":
        from dynaspec.runtime.q8 import Int8WeightLinear

        return Int8WeightLinear(weight, bias)
    if kind == "w8a8":
        from dynaspec.runtime.q8 import Int8WeightLinear

        return Int8WeightLinear(weight, bias, mode="int8")
    raise ValueError(f"no quantised kernel {kind!r}")


#: the drafter's products per target weights setting: int8 weights on the target's kernel (its
#: dense layers, not its head, which the stack's GEMM backend serves), with activations kept within
#: float rounding: a draft step is one row, bound by the weight bytes, and 8-bit activations cost
#: the drafter acceptance (measured on train prompts: first-position acceptance 0.30 -> 0.25)
DRAFTER_KERNELS = {"int8": "int8", "w8a8": "int8"}


def drafter_on_kernel(model: torch.nn.Module, weights: str | None, shared: dict | None = None) -> torch.nn.Module:
    """``model`` (a drafter) with every ``nn.Linear`` computed by the quantised kernel of the target's
    ``weights`` setting (:data:`DRAFTER_KERNELS`; other settings: ``model`` itself). A draft step
    of one row then reads 1 byte a weight instead of the float weights through the float kernels.
    Only proposals change, never the output: verification decides what is committed. ``model``
    itself is left as it is (it may serve engines on other weights): the copy is made once per
    model and kind and kept in ``shared`` (the process's loaded models, when given)."""
    import copy

    kind = DRAFTER_KERNELS.get(weights or "")
    if kind is None or weights_problem(kind) is not None:
        return model
    key = ("drafter-kernel", id(model), kind)
    if shared is not None and key in shared:
        return shared[key][1]
    from dynaspec.runtime import q8
    from dynaspec.runtime.drafter import DecoderLayer, RMSNorm

    quick = copy.deepcopy(model)
    with torch.inference_mode():
        for module in quick.modules():
            if isinstance(module, torch.nn.Linear):
                module.forward = make_kernel(kind, module.weight, module.bias)
            elif isinstance(module, RMSNorm):  # one C call instead of some six tensor operations
                module.forward = functools.partial(_compiled_norm, module, module.weight.detach().float().contiguous(),
                                                   q8.rms_norm)
            elif hasattr(module, "c_norm") and module.c_norm is None:  # the router's weightless norm
                module.c_norm = functools.partial(_weightless_norm, q8.rms_norm)
            elif isinstance(module, DecoderLayer):
                module.fused = fused_products(module, kind)
                if q8.attention_available(module.cfg.head_dim):
                    module.c_attend = functools.partial(q8.attend, lib=q8._library())
    if shared is not None:
        shared[key] = (model, quick)  # the original held too: its id stays its own while cached
    return quick


def fused_products(layer: torch.nn.Module, kind: str) -> dict[str, Linear] | None:
    """The products of a drafter layer that read one input, each as one kernel over their weights
    stacked (a row's outputs are the products of its weight rows alone, so the same values as
    apart, in one call instead of two or three): ``qkv``, ``kv`` (a pass that needs the last
    position's query alone) and ``gate_up``. None where a product has a bias."""
    parts = {"qkv": (layer.q_proj, layer.k_proj, layer.v_proj), "kv": (layer.k_proj, layer.v_proj),
             "gate_up": (layer.gate_proj, layer.up_proj)}
    if any(p.bias is not None for group in parts.values() for p in group):
        return None
    return {name: make_kernel(kind, torch.cat([p.weight for p in group]).contiguous())
            for name, group in parts.items()}


def _weightless_norm(norm, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension by the compiled ``norm``."""
    return norm(x, None, eps)


def _compiled_norm(module: torch.nn.Module, weight: torch.Tensor, norm, x: torch.Tensor) -> torch.Tensor:
    """The drafter's RMS norm ``module`` (weight applied in float32, then rounded) by the compiled
    kernel, for the dtypes it takes; others through the module's own forward."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return type(module).forward(module, x)
    return norm(x, weight, module.eps)


def padded(fn: Linear, good: tuple[int, ...]) -> Linear:
    """``fn`` over 2-D inputs whose row count is padded (with zero rows) up to the next count in
    ``good``; counts beyond the largest good one run as they come."""
    table = {}
    for rows in range(1, max(good) + 1):
        table[rows] = min(g for g in good if g >= rows)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        target = table.get(rows, rows)
        if target == rows:
            return fn(x)
        block = x.new_zeros(target, x.shape[1])
        block[:rows] = x
        return fn(block)[:rows]

    return forward


def _inputs(k: int, rows: int, like: torch.Tensor) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    wide = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-8, 9, (rows, k), generator=gen).float())
    return [x.to(like.dtype) for x in (torch.ones(rows, k), torch.randn(rows, k, generator=gen), wide)]


def probe_quantized(fn: Linear, k: int, like: torch.Tensor, rows: int = PROBE_ROWS) -> str:
    """Which row counts up to ``rows`` compute each row exactly as that row alone in a block of the
    reference size does (every row at every place in the block): ``"stock"`` (all, reference 1),
    ``"pad-to N,M,..."`` (the good counts, the first being the reference) or ``"variant"``.
    Kernels are chosen by shape, never by value, so random inputs (and ones, and inputs spanning
    many binades) on the real weight show any change of summation order or rounding."""
    inputs = _inputs(k, rows, like)
    with torch.inference_mode():
        for reference in range(1, 5):
            def alone(x, i, reference=reference):
                block = x.new_zeros(reference, k)
                block[0] = x[i]
                return fn(block)[0]

            singles = [torch.stack([alone(x, i) for i in range(rows)]) for x in inputs]
            good = tuple(r for r in range(1, rows + 1)
                         if all(torch.equal(fn(x[:r]), single[:r]) for x, single in zip(inputs, singles)))
            if reference in good and all(r in good for r in range(reference, min(reference + 2, rows) + 1)):
                if good == tuple(range(1, rows + 1)):
                    return "stock"
                return "pad-to " + ",".join(map(str, good))
    return "variant"


def quantized_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     rows: int = PROBE_ROWS) -> tuple[str, Linear, Linear]:
    """``(verdict, strict, relaxed)`` products of ``weight`` in ``kind`` (the verdict names the
    kind: ``"stock (int8)"``, ``"pad-to 3,4,5 (float16)"``): the strict one padded as
    the probe says (:func:`probe_quantized`, remembered per machine), the relaxed one as it comes.
    A ``variant`` kernel is returned as it comes, and the verdict says so."""
    from dynaspec.runtime.batch_invariance import _machine, verdicts_file
    from dynaspec.runtime.cache import read_json, update_json

    if isinstance(weight, PackedWeight):
        if weight.kind != kind:
            raise ValueError(f"a weight packed for the {weight.kind} kernel, asked for {kind}")
        fn = weight.kernel
    else:
        fn = make_kernel(kind, weight, bias)
    # the code path a kernel takes is part of what is probed: AMX tiles (q8) are remembered apart
    path = ["amx"] if getattr(fn, "amx", False) else []
    key = "|".join([_machine(), f"quantized{PROBE_VERSION}", kind, "x".join(map(str, weight.shape)),
                    str(bias is not None), f"rows{rows}", *path])
    verdict = read_json(verdicts_file()).get(key)
    if verdict is None:
        verdict = probe_quantized(fn, weight.shape[1], weight, rows)
        update_json(verdicts_file(), {key: verdict})
    if verdict.startswith("pad-to"):
        good = tuple(int(r) for r in verdict.split()[1].split(","))
        return f"{verdict} ({kind})", padded(fn, good), fn
    return f"{verdict} ({kind})", fn, fn
