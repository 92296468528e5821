"""Int8 weights on a CPU: the kernel in ``kernels/q8_linear.c``, built at first use.

Each weight row is stored as int8 with one float32 scale (its largest magnitude over 127). The
kernel converts a tile of weights once for every group of activation rows, so a verification of a
few rows reads the weights once, and every result is computed by the same operations whatever the
number of rows (see the C file): rows never depend on how many are computed together, by
construction. Two modes (:data:`MODES`): activations in float32 with FMAs, or each activation row
quantised to int16 with a scale of its own and integer dot products (AVX-512 VNNI or AVX2), whose
sums are exact; the second is the default where it runs. ``int8`` activations (``weights =
"w8a8"``) run on AMX tiles where the processor has them (Intel, Sapphire Rapids on; :func:`amx`):
the same integer sums, so the same results bit for bit, with up to 16 rows for about the cost of
one (the weights are packed for the tiles instead).

The C file is compiled with the machine's C compiler (``$CC``, else ``cc``) for its own processor
(``-march=native``) into the cache root, once per source, compiler and processor; the shared
library is loaded with :mod:`ctypes`. Without a compiler the kernel is unavailable and
:func:`available` says why; ``weights = "auto"`` then falls back.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Sequence

import torch

from dynaspec.errors import ConfigError

SOURCE = Path(__file__).with_name("kernels") / "q8_linear.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
LIBS = ("-lm",)
#: bfloat16 rows on AMX tiles get bfloat16 outputs from the kernel's epilogue (the same bits as the
#: float32 outputs converted by torch; False: converted by torch, for side-by-side timing)
BF16_EPILOGUE = True


def set_amx_pairs(on: bool, level: str | None = None) -> None:
    """Whether the AMX tiles take groups of 16 rows in pairs, each weight tile serving both (the
    default; a product over many rows, a prefill, reads the weights from the cache half as often),
    or one by one; the same outputs either way (for side-by-side timing)."""
    _library(level).q8_set_amx_pairs(int(on))


def set_amx_attend(on: bool, level: str | None = None) -> None:
    """Whether :func:`attend` runs bfloat16 rows on AMX tiles where the processor has them (the
    default: a row over 400 keys in about half the time) or on the AVX-512 vector code. The two are
    two roundings of the same attention (the tiles round the softmax weights to bfloat16 for the
    values' products), each batch-invariant; the choice holds for the whole process, so plain steps
    and verifications always run under the same one (for side-by-side runs;
    ``$DYNASPEC_Q8_AMX_ATTEND=0``, or ``$DYNASPEC_Q8_AMX=0`` with the products, turns it off)."""
    _library(level).q8_set_amx_attend(int(on))


def attention_on_tiles(level: str | None = None) -> bool:
    """Whether :func:`attend` runs bfloat16 rows on AMX tiles here."""
    return bool(_library(level).q8_attend_amx())


#: the instruction sets the kernel can be built for: the processor's best (``native``), or lower,
#: to run and test its other code paths here (``$DYNASPEC_Q8_ISA`` chooses for a process)
LEVELS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, out: Path, openmp: bool, level: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        cmd = [cc, *FLAGS, *LEVELS[level], *(["-fopenmp"] if openmp else []), str(SOURCE), "-o", str(tmp_lib), *LIBS]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp_lib, out)  # atomic: a concurrent process sees the whole library or none


def _library(level: str | None = None) -> ctypes.CDLL:
    """The compiled kernel for ``level`` (see :data:`LEVELS`; default ``$DYNASPEC_Q8_ISA`` or
    ``native``), built into the cache root on first use (raises OSError on failure)."""
    level = level or os.environ.get("DYNASPEC_Q8_ISA") or "native"
    if level not in LEVELS:
        raise OSError(f"DYNASPEC_Q8_ISA={level!r}: one of {', '.join(LEVELS)}")
    return _library_for(level)


@functools.lru_cache(maxsize=None)
def _library_for(level: str) -> ctypes.CDLL:
    from dynaspec.runtime.batch_invariance import processor
    from dynaspec.runtime.cache import cache_root

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise OSError(f"the int8 kernel is written for x86-64 processors, not {platform.machine()}")
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc or clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS + LEVELS[level]), cc, *version,
                                    *processor()]).encode()).hexdigest()[:16]
    lib_path = cache_root() / "kernels" / f"q8_linear-{level}-{key}.so"
    if not lib_path.exists():
        try:
            _build(cc, lib_path, True, level)
        except OSError:
            _build(cc, lib_path, False, level)  # a compiler without OpenMP: one thread
    lib = ctypes.CDLL(str(lib_path))
    lib.q8_linear.restype = None
    lib.q8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.q8_isa.restype = ctypes.c_char_p
    lib.q8_round_bf16.restype = None
    lib.q8_round_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.q8_argmax.restype = ctypes.c_int64
    lib.q8_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    for name in ("q8_lanes", "q8_tile_rows", "q8_int16_available", "q8_int16_lanes", "q8_u8_available", "q8_u8_lanes",
                 "q8_u8_chunk", "q8_rows_u8_available"):
        getattr(lib, name).restype = ctypes.c_int
    lib.q8_quantize_pack.restype = None
    lib.q8_quantize_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_rows.restype = lib.q8_quantize_rowmajor.restype = None
    lib.q8_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.q8_rows_u8.restype = None
    lib.q8_rows_u8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int]
    lib.q8_quantize_rowmajor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_linear_i16.restype = None
    lib.q8_linear_i16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_linear_u8.restype = lib.q8_linear_amx.restype = lib.q8_linear_amx_bf16.restype = None
    lib.q8_linear_u8.argtypes = lib.q8_linear_amx.argtypes = lib.q8_linear_amx_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_amx_available.restype = lib.q8_amx_rows.restype = ctypes.c_int
    lib.q8_set_amx_pairs.restype = None
    lib.q8_set_amx_pairs.argtypes = [ctypes.c_int]
    lib.q8_amx_max_k.restype = ctypes.c_int64
    lib.q8_attend_vector.restype = lib.q8_attend_amx.restype = ctypes.c_int
    lib.q8_set_amx_attend.restype = None
    lib.q8_set_amx_attend.argtypes = [ctypes.c_int]
    if "0" in (os.environ.get("DYNASPEC_Q8_AMX", "1"), os.environ.get("DYNASPEC_Q8_AMX_ATTEND", "1")):
        lib.q8_set_amx_attend(0)
    lib.q8_attend.restype = ctypes.c_int
    lib.q8_attend.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    lib.q8_rms_norm.restype = None
    lib.q8_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    lib.q8_add_rms_norm.restype = None
    lib.q8_add_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_silu_mul.restype = lib.q8_rope.restype = None
    lib.q8_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.q8_rope.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_void_p]
    return lib


def available(device: torch.device | str = "cpu", level: str | None = None) -> str | None:
    """None where the int8 kernel runs on ``device``, else why not."""
    if torch.device(device).type != "cpu":
        return f"the int8 kernel runs on a CPU, not on {torch.device(device)}"
    try:
        _library(level)
    except OSError as err:
        return str(err)
    return None


def isa(level: str | None = None) -> str:
    """The instruction set the kernel was built for here: ``avx512``, ``avx2`` or ``scalar``."""
    return _library(level).q8_isa().decode()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, round_first: bool = False,
             lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, each row on its own, in
    float32, for a float32 or bfloat16 ``x`` (returned in its dtype); ``weight`` is float32.
    ``round_first``: the normed row is rounded to ``x``'s dtype before ``weight`` multiplies it
    (Llama's order; Gemma's multiplies first). One C call instead of some eight tensor operations:
    a decoding step of a small target normalises over a hundred short rows. ``lib``: the library
    (:func:`_library`), for callers in the decode loop that look it up once."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rms_norm of {x.dtype}: float32 or bfloat16")
    d = x.shape[-1]
    if weight is not None and (weight.dtype != torch.float32 or weight.numel() != d or not weight.is_contiguous()):
        raise ValueError(f"rms_norm weight must be a contiguous float32 vector of {d}")
    x = x.contiguous()
    out = torch.empty_like(x)
    (lib or _library()).q8_rms_norm(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // max(d, 1), d,
                           None if weight is None else weight.data_ptr(), int(round_first), eps, out.data_ptr())
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                 round_first: bool = False, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta, weight, eps))`` in one C call: a residual connection (the
    sum rounded to the dtype as torch's addition rounds it) and the norm that reads it, the same bits
    as the two apart (:func:`rms_norm`)."""
    if h.dtype not in (torch.float32, torch.bfloat16) or delta.dtype != h.dtype or delta.shape != h.shape:
        raise ValueError(f"add_rms_norm of {h.dtype} {tuple(h.shape)} and {delta.dtype} {tuple(delta.shape)}: "
                         "float32 or bfloat16, alike")
    d = h.shape[-1]
    if weight is not None and (weight.dtype != torch.float32 or weight.numel() != d or not weight.is_contiguous()):
        raise ValueError(f"add_rms_norm weight must be a contiguous float32 vector of {d}")
    h, delta = h.contiguous(), delta.contiguous()
    total, normed = torch.empty_like(h), torch.empty_like(h)
    (lib or _library()).q8_add_rms_norm(h.data_ptr(), delta.data_ptr(), int(h.dtype == torch.bfloat16),
                                        h.numel() // max(d, 1), d, None if weight is None else weight.data_ptr(),
                                        int(round_first), eps, total.data_ptr(), normed.data_ptr())
    return total, normed


def silu_mul(gate_up: torch.Tensor, width: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``silu(gate_up[:, :width]) * gate_up[:, width:]`` for 2-D float32 or bfloat16 rows of ``2 *
    width`` (a gated MLP's gate and up products side by side), in one C call: each element on its
    own, bfloat16 rounded after the activation and after the product as torch's operations round
    (the exponential is the attention kernel's, of ``-|gate|`` only: within float32 rounding of
    torch's activation, not its bits)."""
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.dim() != 2 or gate_up.shape[1] != 2 * width:
        raise ValueError(f"silu_mul of {gate_up.dtype} {tuple(gate_up.shape)}: float32 or bfloat16 rows of {2 * width}")
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype)
    (lib or _library()).q8_silu_mul(gate_up.data_ptr(), int(gate_up.dtype == torch.bfloat16), gate_up.shape[0], width,
                                    out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The rotary embedding ``x * cos + rotate_half(x) * sin`` of ``x`` [T, H, D] (rows of heads;
    each row's heads contiguous, the rows at any stride) with ``cos`` and ``sin`` [T, 1, D] (each
    row's angles, shared by its heads), in one C call, as torch's operations compute it in the same
    dtype (float32 or bfloat16: each product rounded, then the sum), bit for bit. Returns a
    contiguous [T, H, D]."""
    t, heads, d = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"rope of {x.dtype} with {cos.dtype} angles: float32 or bfloat16, the same for all")
    if (x.stride(1), x.stride(2)) != (d, 1) or d % 2:
        raise ValueError(f"rope needs each row's heads contiguous and an even head size, got strides {x.stride()}")
    if cos.shape != (t, 1, d) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(2) != 1:
        raise ValueError(f"rope angles of {tuple(cos.shape)} for rows {tuple(x.shape)}: [T, 1, D], laid out alike")
    out = torch.empty(t, heads, d, dtype=x.dtype)
    (lib or _library()).q8_rope(x.data_ptr(), int(x.dtype == torch.bfloat16), t, heads, d, x.stride(0), cos.data_ptr(),
                                sin.data_ptr(), cos.stride(0), out.data_ptr())
    return out


def attention_available(head_dim: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`attend` runs vectorised here for heads of ``head_dim`` (AVX-512 or AVX2; 64, 128 or
    256 wide); elsewhere torch's attention is as fast or faster."""
    try:
        lib = lib or _library()
    except OSError:
        return False
    return bool(lib.q8_attend_vector()) and head_dim in (64, 128, 256)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: Sequence[int], scale: float,
           window: int | None = None, *, lib: ctypes.CDLL | None = None,
           lines: Sequence[Sequence[int]] | None = None, base: int = 0) -> torch.Tensor:
    """Attention of the rows ``q`` [T, H, D] over ``keys`` and ``values`` [1, Hkv, L, D] (views of a
    KV buffer, read in place), row ``i`` over the keys before ``ends[i]`` (and within ``window`` of
    it): [T, H * D] in ``q``'s dtype, float32 inside. Each row is computed on its own, the same way
    whatever the other rows (see kernels/q8_linear.c), so a chain's rows attended in one call equal
    the plain steps that attend them one by one. One C call instead of a torch attention call per
    row; ``lib``: the library (:func:`_library`), for callers that look it up once.

    ``lines`` (a draft tree's rows): row ``i`` reads the cache entries before ``base``, then the
    entries ``lines[i]`` (its ancestors' and its own, in order) as if they followed at ``base``,
    ``base + 1``, ...; its end is ``base + len(lines[i])`` (``ends`` is ignored). That is what the
    plain step at that position computes once the row's line is moved there, bit for bit."""
    t, h, d = q.shape
    hkv = keys.shape[1]
    if q.dtype not in (torch.float32, torch.bfloat16) or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(f"attend of {q.dtype} over {keys.dtype} keys: float32 or bfloat16, all alike")
    length = keys.shape[2]
    slots = off = None
    if lines is not None:
        lines = [list(line) for line in lines]
        if len(lines) != t or any(not line for line in lines):
            raise ValueError(f"attend: {len(lines)} lines for {t} rows (each with its own entry at least)")
        flat = [s for line in lines for s in line]
        if not 0 <= base <= length or any(not base <= s < length for s in flat):
            raise ValueError(f"attend: a line's entries outside {base}..{length - 1}")
        ends = [base + len(line) for line in lines]
        slots = (ctypes.c_int64 * len(flat))(*flat)
        off = (ctypes.c_int64 * t)(*itertools.accumulate((len(line) for line in lines[:-1]), initial=0))
    ends = list(ends)
    if len(ends) != t or h % hkv or keys.shape[-1] != d or values.shape != keys.shape:
        raise ValueError(f"attend: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
                         f"{len(ends)} ends")
    if q.stride(2) != 1 or q.stride(1) != d or keys.stride() != values.stride() or keys.stride(3) != 1:
        raise ValueError("attend: q's heads and the cache's positions must be laid out contiguously")
    if lines is None and any(not 0 < e <= length for e in ends):
        raise ValueError(f"attend: row ends {list(ends)} outside 1..{length}")
    end = (ctypes.c_int64 * t)(*ends)
    start = (ctypes.c_int64 * t)(*(max(0, e - window) if window else 0 for e in ends))
    out = torch.empty(t, h * d, dtype=q.dtype)
    rc = (lib or _library()).q8_attend(q.data_ptr(), int(q.dtype == torch.bfloat16), t, h, hkv, d, q.stride(0),
                                       keys.data_ptr(), values.data_ptr(), keys.stride(1), keys.stride(2),
                                       start, end, slots, off, base, scale, out.data_ptr())
    if rc:
        raise MemoryError("attend: no memory for the scores")
    return out


#: how the kernel multiplies (see kernels/q8_linear.c): ``float`` (activations as float32, FMAs),
#: ``int16`` (each activation row quantised to int16 with a scale of its own, integer dot products
#: on AVX-512 VNNI or AVX2: exact integer sums, the weights widened in one instruction per 32 or
#: 16, and about half the cost of ``float`` for a verification's four to eight rows), ``int8``
#: (each activation row quantised to int8 with a scale of its own, u8 x s8 dot products on AVX-512
#: VNNI: exact integer sums, 64 products an instruction with no widening; activations lose more
#: precision, see docs/results.md for what it costs in quality)
MODES = ("float", "int16", "int8")


def modes(level: str | None = None) -> tuple[str, ...]:
    """The modes the kernel built for ``level`` runs here."""
    lib = _library(level)
    return ("float",) + (("int16",) if lib.q8_int16_available() else ()) + (("int8",) if lib.q8_u8_available() else ())


def amx(level: str | None = None) -> bool:
    """Whether ``int8`` products run on AMX tiles here (Intel's TMUL, from Sapphire Rapids on): the
    same results bit for bit as the AVX-512 VNNI code, with up to 16 rows for about the cost of one.
    ``$DYNASPEC_Q8_AMX=0`` turns them off (to compare the two)."""
    if os.environ.get("DYNASPEC_Q8_AMX", "1") == "0":
        return False
    return bool(_library(level).q8_amx_available())


def default_mode(level: str | None = None) -> str:
    """The mode used when none is asked for: ``int16`` where AVX2 or AVX-512 VNNI exists, else
    ``float`` (both keep activations within rounding of float32; ``int8`` is asked for by name)."""
    return "int16" if "int16" in modes(level) else "float"


@functools.lru_cache(maxsize=1)
def _argmax_library() -> ctypes.CDLL | None:
    """The kernel library for :func:`argmax`, looked up once (None: unavailable here)."""
    try:
        return _library()
    except OSError:
        return None


def argmax(row: torch.Tensor) -> int:
    """``int(row.argmax())``: the flat index of the first largest value of a row of logits, on the
    compiled kernel for a contiguous float32 CPU tensor (a vocabulary-wide row in a tenth of
    torch's time: 0.02 ms against 0.2 ms here for Qwen's 151,936 logits), else, and for a row with
    a NaN, torch's."""
    if row.dtype == torch.float32 and row.device.type == "cpu" and row.is_contiguous() and row.numel():
        lib = _argmax_library()
        if lib is not None:
            found = lib.q8_argmax(row.data_ptr(), row.numel())
            if found >= 0:
                return int(found)
    return int(row.argmax())


#: per thread and activation dtype: the scratch buffers every product's activation rows are
#: quantised into, grown to the largest call seen (a buffer per product and row count would keep
#: one per prompt length: memory without bound in a server, and fresh pages on every new length)
_SCRATCH: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _thread_scratch(dtype: torch.dtype, elements: int, rows: int) -> tuple[int, int]:
    """``(xq, sx)`` pointers: at least ``elements`` of ``dtype`` and ``rows`` float32 scales. Each
    thread reads and replaces only its own key."""
    key = (threading.get_ident(), dtype)
    xq, sx = _SCRATCH.get(key) or (torch.empty(0, dtype=dtype), torch.empty(0))
    if xq.numel() < elements or sx.numel() < rows:
        xq = torch.zeros(max(elements, xq.numel()), dtype=dtype)
        sx = torch.empty(max(rows, sx.numel()), dtype=torch.float32)
        _SCRATCH[key] = xq, sx
    return xq.data_ptr(), sx.data_ptr()


#: every kernel's weights read whole on each call: (owner, attribute) of the int8 matrices that
#: :func:`huge_pages` may move (weakly held: a kernel no one uses is not kept alive by this)
_STREAMED: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()
_HUGE = 2 << 20


def _huge_arena(size: int) -> torch.Tensor | None:
    """``size`` bytes of private anonymous memory, 2 MiB-aligned, that the kernel is asked to back
    with transparent huge pages (None where this system has no such advice)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    area = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(advice)
    except OSError:
        return None
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -whole.data_ptr() % _HUGE
    return whole[start:start + size]


def huge_pages(min_bytes: int = 1 << 18) -> int:
    """Move the int8 weights of every live kernel (:class:`Int8WeightLinear`, :class:`Int8Rows`)
    of at least ``min_bytes`` that have not moved yet into one arena of memory backed by
    transparent huge pages (2 MiB pages; Linux, where the system allows them): a decoding step
    streams every weight byte once, and over 4 KiB pages (an image's file mapping, or memory
    allocated without the advice) each page costs a translation of its own. Measured on the Xeon:
    480 MB read in 33 ms from huge pages against 42-44 ms from the file mapping. Returns the bytes
    moved (0 where nothing moved or the system has no huge pages to give). The values are copied
    bit for bit; ``$DYNASPEC_HUGE_PAGES=0`` turns it off. Call it while no other thread runs
    these kernels (an engine calls it as it is assembled): a moved matrix's old memory is freed."""
    if os.environ.get("DYNASPEC_HUGE_PAGES", "1") == "0":
        return 0
    todo = [(owner, name) for owner, name in list(_STREAMED.items())
            if getattr(owner, name).numel() * getattr(owner, name).element_size() >= min_bytes]
    if not todo:
        return 0
    sizes = [-(-getattr(o, n).numel() * getattr(o, n).element_size() // 4096) * 4096 for o, n in todo]
    arena = _huge_arena(sum(sizes))
    if arena is None:
        return 0
    at = 0
    with torch.inference_mode():
        for (owner, name), size in zip(todo, sizes):
            old = getattr(owner, name)
            nbytes = old.numel() * old.element_size()
            new = arena[at:at + nbytes].view(old.dtype).view(old.shape)
            new.copy_(old)
            setattr(owner, name, new)
            _STREAMED.pop(owner, None)  # moved once
            at += size
    return at


class Int8WeightLinear:
    """``F.linear`` with int8 weights (one scale per output row), through the compiled kernel:
    rows never depend on how many are computed together. ``mode`` (:data:`MODES`; default
    :func:`default_mode`) says how the activations enter the products. Inputs of any float dtype
    are accepted (float32 and bfloat16 are read as they are); results are returned in the input's
    dtype."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, level: str | None = None,
                 mode: str | None = None) -> None:
        if weight.dim() != 2:
            raise ConfigError(f"an int8 product needs a 2-D weight, got shape {tuple(weight.shape)}")
        self._lib = _library(level)
        self.mode = mode or default_mode(level)
        if self.mode not in modes(level):
            raise ConfigError(f"int8 kernel mode {self.mode!r} does not run here: {', '.join(modes(level))} do")
        self.out_features, self.in_features = weight.shape
        self._layout = self._kernel_layout()
        lanes = self._layout[0]
        # integer modes: K padded with zero weights to a whole number of steps (no tail columns)
        self._padded_in = -(-self.in_features // lanes) * lanes if self.mode != "float" else self.in_features
        with torch.inference_mode():  # quantised and packed in one pass (see q8_quantize_pack)
            w = weight.detach()
            w = (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()).contiguous()
            n, kp, tile_rows = self.out_features, self._padded_in, self._layout[1]
            kv = kp - kp % lanes
            self.packed = torch.empty(-(-n // tile_rows) * tile_rows * kv, dtype=torch.int8)
            self.tail = torch.empty(n, kp - kv, dtype=torch.int8)
            self.scale = torch.empty(n, dtype=torch.float32)
            self._lib.q8_quantize_pack(w.data_ptr(), int(w.dtype == torch.bfloat16), n, self.in_features, kp, lanes,
                                       self.packed.data_ptr(), self.tail.data_ptr(), self.scale.data_ptr())
            # int8 mode: each row's sum of int8 weights, which takes the activations' offset out
            self.row_sums = (self.packed.view(-1, kv // lanes, tile_rows, lanes).sum((1, 3), dtype=torch.int32)
                             .reshape(-1)[:n].contiguous() if self.mode == "int8" else None)
            self.amx = self._on_tiles(kp, level)
            self._chunk = self._lib.q8_u8_chunk() if self.mode == "int8" and not self.amx else 0
            if self.amx:
                self.packed = self._amx_packed(self._rowmajor(self.packed))
            elif self._chunk:
                self.packed = self._chunked(self.packed)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        _STREAMED[self] = "packed"

    def _chunk_steps(self) -> list[tuple[int, int]]:
        """(first step, steps) of each column chunk of the packed weights (one chunk: all of them)."""
        lanes = self._layout[0]
        steps = (self._padded_in - self._padded_in % lanes) // lanes
        per = max(1, self._chunk // lanes) if self._chunk else max(steps, 1)
        return [(at, min(per, steps - at)) for at in range(0, steps, per)]

    def _chunked(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` (tiles of [steps][tile rows][lanes]) in column chunks, as the int8-activation
        kernel reads it (kernels/q8_linear.c: each chunk holds every tile's columns of the chunk)."""
        lanes, tile_rows = self._layout
        body = packed.view(-(-self.out_features // tile_rows), -1, tile_rows, lanes)
        return torch.cat([body[:, at:at + n].reshape(-1) for at, n in self._chunk_steps()])

    def _on_tiles(self, padded_in: int, level: str | None) -> bool:
        """Whether this product runs on AMX tiles: 8-bit activations, tiles here, and rows short
        enough that a tile's int32 sums cannot overflow."""
        return self.mode == "int8" and amx(level) and padded_in <= self._lib.q8_amx_max_k()

    def _rowmajor(self, tiled: torch.Tensor) -> torch.Tensor:
        """The tiled columns of the weights as rows [N, kv] (all Kp of them in an integer mode,
        which has no tail), from tiles of [steps][tile rows][lanes]."""
        lanes, tile_rows = self._layout
        tiles, kv = -(-self.out_features // tile_rows), self._padded_in - self._padded_in % lanes
        rows = tiled.view(tiles, kv // lanes, tile_rows, lanes).transpose(1, 2)
        return rows.reshape(tiles * tile_rows, kv)[:self.out_features]

    def _amx_packed(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [N, Kp] in the AMX kernel's layout (kernels/q8_linear.c): blocks of 64 outputs (N
        padded with zero rows), each step of 64 columns as four tiles of [16 quads][16 outputs][4]."""
        blocks = -(-self.out_features // 64)
        padded = torch.zeros(blocks * 64, self._padded_in, dtype=torch.int8)
        padded[:self.out_features] = rows
        steps = self._padded_in // 64
        return padded.view(blocks, 4, 16, steps, 16, 4).permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1)

    def _amx_rows(self) -> torch.Tensor:
        """The AMX layout's weights as rows [N, Kp] (the inverse of :meth:`_amx_packed`)."""
        blocks, steps = -(-self.out_features // 64), self._padded_in // 64
        body = self.packed.view(blocks, steps, 4, 16, 16, 4).permute(0, 2, 4, 1, 3, 5)
        return body.reshape(blocks * 64, self._padded_in)[:self.out_features]

    def _tiled(self) -> torch.Tensor:
        """The packed weights as tiles of [steps][tile rows][lanes], whatever the chunking (or the
        AMX layout)."""
        lanes, tile_rows = self._layout
        tiles = -(-self.out_features // tile_rows)
        if self.amx:
            rows = torch.zeros(tiles * tile_rows, self._padded_in, dtype=torch.int8)
            rows[:self.out_features] = self._amx_rows()
            return rows.view(tiles, tile_rows, -1, lanes).transpose(1, 2).contiguous().reshape(-1)
        parts, at = [], 0
        for _, n in self._chunk_steps():
            size = tiles * n * tile_rows * lanes
            parts.append(self.packed[at:at + size].view(tiles, n, tile_rows, lanes))
            at += size
        return torch.cat(parts, dim=1).reshape(-1) if len(parts) > 1 else self.packed

    def _kernel_layout(self) -> tuple[int, int]:
        """(lanes, tile rows) the kernel built here packs for in this mode."""
        lanes = {"float": self._lib.q8_lanes, "int16": self._lib.q8_int16_lanes, "int8": self._lib.q8_u8_lanes}
        return lanes[self.mode](), self._lib.q8_tile_rows()

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The packed weights (tensors) and what they were packed for (numbers), to be saved and
        restored by :meth:`from_state` without quantising again."""
        tensors = {"packed": self.packed, "tail": self.tail, "scale": self.scale}
        if self.row_sums is not None:
            tensors["row_sums"] = self.row_sums
        if self.bias is not None:
            tensors["bias"] = self.bias
        meta = {"mode": self.mode, "out_features": self.out_features, "in_features": self.in_features,
                "padded_in": self._padded_in, "layout": list(self._layout), "chunk": self._chunk,
                "amx": self.amx}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict, level: str | None = None) -> "Int8WeightLinear":
        """The product :meth:`state` saved, on the kernel built here: refused (ValueError) where
        this kernel packs for another layout (lanes and tile rows depend on the instruction set)."""
        self = cls.__new__(cls)
        self._lib = _library(level)
        self.mode = meta["mode"]
        if self.mode not in modes(level):
            raise ValueError(f"int8 kernel mode {self.mode!r} does not run here")
        layout = self._kernel_layout()
        lanes = layout[0]
        if tuple(meta["layout"]) != layout:
            raise ValueError(f"packed for lanes and tile rows {tuple(meta['layout'])}, this kernel uses {layout}")
        self._layout = layout
        self.amx = self._on_tiles(int(meta["padded_in"]), level)
        if bool(meta.get("amx", False)) != self.amx:
            raise ValueError(f"packed {'for' if meta.get('amx') else 'without'} AMX tiles, this kernel reads "
                             f"{'them' if self.amx else 'none'}")
        self._chunk = self._lib.q8_u8_chunk() if self.mode == "int8" and not self.amx else 0
        if int(meta.get("chunk", 0)) != self._chunk:
            raise ValueError(f"packed in column chunks of {meta.get('chunk', 0)}, this kernel reads {self._chunk}")
        self.out_features, self.in_features = int(meta["out_features"]), int(meta["in_features"])
        self._padded_in = int(meta["padded_in"])
        kv = self._padded_in - self._padded_in % lanes
        tiles = -(-self.out_features // layout[1])
        packed_size = -(-self.out_features // 64) * 64 * kv if self.amx else tiles * layout[1] * kv
        expected = {"packed": ((packed_size,), torch.int8),
                    "tail": ((self.out_features, self._padded_in - kv), torch.int8),
                    "scale": ((self.out_features,), torch.float32)}
        if self.mode == "int8":
            expected["row_sums"] = ((self.out_features,), torch.int32)
        if "bias" in tensors:
            expected["bias"] = ((self.out_features,), torch.float32)
        for name, (shape, dtype) in expected.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"packed tensor {name!r} missing or not {dtype} of shape {shape}")
        self.packed, self.tail, self.scale = tensors["packed"], tensors["tail"], tensors["scale"]
        self.row_sums = tensors.get("row_sums") if self.mode == "int8" else None
        self.bias = tensors.get("bias")
        _STREAMED[self] = "packed"
        return self

    def quantised_weight(self) -> torch.Tensor:
        """The weight as the kernel sees it, dequantised (float32): for quality checks."""
        body = self._amx_rows() if self.amx else self._rowmajor(self._tiled())
        q = torch.cat([body, self.tail], dim=1)[:, :self.in_features]
        return q.float() * self.scale[:, None]

    def _scratch_for(self, m: int) -> tuple[int, int]:
        """Pointers to scratch for ``m`` quantised activation rows and their scales (integer modes):
        the calling thread's buffers, shared by every product (they never leave the C call that
        fills them; the kernel writes every column of the rows it reads, padding included)."""
        # AMX tiles read whole groups of 16 rows (those past m: whatever is there, their sums dropped)
        rows = -(-m // self._lib.q8_amx_rows()) * self._lib.q8_amx_rows() if self.amx else m
        return _thread_scratch(torch.uint8 if self.mode == "int8" else torch.int16, rows * self._padded_in, m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.amx and self.mode == "int8" and BF16_EPILOGUE:
            # bfloat16 rows on the tiles: the kernel writes the outputs as bfloat16 itself, rounded
            # as the conversion below rounds them (the same bits, without a float32 copy to convert)
            return self._product(x, bf16_out=True)
        out = self._product(x)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def float_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` without its two copies: the float32 product, for bfloat16 ``x``
        rounded in place to bfloat16's precision (as the conversions round). For an LM head, whose
        rows are vocabulary-wide: about 1 ms less for a verification of 9 rows here."""
        out = self._product(x)
        if x.dtype == torch.bfloat16:
            self._lib.q8_round_bf16(out.data_ptr(), out.numel())
        elif x.dtype != torch.float32:
            out = out.to(x.dtype).float()
        return out

    def _product(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """The product in float32 (``bf16_out``, AMX int8 only: rounded to bfloat16 by the kernel),
        shaped as ``x`` with ``out_features`` last."""
        shape = x.shape
        if shape[-1] != self.in_features:
            raise ValueError(f"input of {shape[-1]} features for a product with {self.in_features} input features")
        rows = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.bfloat16 if bf16_out else torch.float32)
        if m:
            bias = None if self.bias is None else self.bias.data_ptr()
            threads = torch.get_num_threads()
            if self.mode in ("int8", "int16"):  # activations quantised per row into scratch
                rows = rows.contiguous() if rows.dtype in (torch.float32, torch.bfloat16) else rows.float().contiguous()
                bf16 = int(rows.dtype == torch.bfloat16)
                xq, sx = self._scratch_for(m)
                if self.mode == "int8":
                    kernel = (self._lib.q8_linear_amx_bf16 if bf16_out else self._lib.q8_linear_amx) if self.amx \
                        else self._lib.q8_linear_u8
                    kernel(rows.data_ptr(), bf16, m, self.in_features, self._padded_in, self.packed.data_ptr(),
                           self.row_sums.data_ptr(), self.scale.data_ptr(), bias, self.out_features, out.data_ptr(),
                           threads, xq, sx)
                else:
                    self._lib.q8_linear_i16(rows.data_ptr(), bf16, m, self.in_features, self._padded_in,
                                            self.packed.data_ptr(), self.scale.data_ptr(), bias, self.out_features,
                                            out.data_ptr(), threads, xq, sx)
            else:
                rows = rows.float().contiguous()
                self._lib.q8_linear(rows.data_ptr(), m, self.in_features, self.packed.data_ptr(), self.tail.data_ptr(),
                    self.scale.data_ptr(), bias, self.out_features, out.data_ptr(), threads)
        if x.dim() != 2:
            out = out.reshape(*shape[:-1], self.out_features)
        return out


#: what :class:`Int8Rows` multiplies its rows by: int8 activations, float32 ones, or int8 where they run
ROWS_ACTIVATIONS = ("auto", "int8", "float")


class Int8Rows:
    """A matrix as int8 rows (one scale each, as :class:`Int8WeightLinear`), stored row by row, whose
    chosen rows multiply the activations in place (:meth:`logits`): a draft head over a shortlist
    reads 1 byte per weight of the shortlisted rows and copies nothing. ``activations``: ``"int8"``
    quantises the activations too, one scale a row (AVX-512 VNNI: ``q8_rows_u8``, a quarter of the
    instructions of float32 products and four rows' loads in flight), ``"float"`` multiplies them in
    float32 (``q8_rows``), ``"auto"`` is ``"int8"`` where it runs. ``order`` (optional, a
    permutation of the rows) stores them in that order, so that a shortlist of whole clusters is
    read as contiguous runs."""

    def __init__(self, weight: torch.Tensor, order: torch.Tensor | None = None, level: str | None = None,
                 activations: str = "auto") -> None:
        if weight.dim() != 2:
            raise ConfigError(f"int8 rows need a 2-D weight, got shape {tuple(weight.shape)}")
        if activations not in ROWS_ACTIVATIONS:
            raise ConfigError(f"int8 rows' activations must be one of {', '.join(ROWS_ACTIVATIONS)}, got {activations!r}")
        self._lib = _library(level)
        vnni = bool(self._lib.q8_rows_u8_available())
        if activations == "int8" and not vnni:
            raise ConfigError("int8 activations in the int8 rows need AVX-512 VNNI, which this processor "
                              "(or kernel level) lacks; use activations = \"float\" or \"auto\"")
        #: the activations are quantised to int8 (else multiplied in float32)
        self.int8_activations = vnni and activations != "float"
        self.rows, self.in_features = weight.shape
        w = weight.detach()
        w = (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()).contiguous()
        with torch.inference_mode():
            q = torch.empty(self.rows, self.in_features, dtype=torch.int8)
            scale = torch.empty(self.rows, dtype=torch.float32)
            self._lib.q8_quantize_rowmajor(w.data_ptr(), int(w.dtype == torch.bfloat16), self.rows, self.in_features,
                                           q.data_ptr(), scale.data_ptr())
            self.position = None  # where each row is stored (None: in place)
            if order is not None:
                order = order.to(torch.long)
                q, scale = q.index_select(0, order).contiguous(), scale.index_select(0, order).contiguous()
                self.position = torch.empty_like(order)
                self.position[order] = torch.arange(len(order))
        self.q, self.scale = q, scale
        _STREAMED[self] = "q"

    def logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``hidden @ W[ids].T`` ([M, len(ids)]) for 2-D ``hidden`` and 1-D row ``ids``: with
        8-bit activations, ``((xq . q[id]) * sx) * scale[id]`` for ``hidden`` quantised as a weight
        row is (an exact integer sum), else the float32 sums of ``hidden`` times the int8 rows."""
        x = hidden.float().contiguous()
        ids = ids.to(torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise ValueError(f"row ids outside 0..{self.rows - 1}")
        where = (ids if self.position is None else self.position[ids]).contiguous()
        out = torch.empty(x.shape[0], where.numel(), dtype=torch.float32)
        if out.numel() and self.int8_activations:  # the rows quantised into the thread's scratch
            m = x.shape[0]
            xq, sx = _thread_scratch(torch.int8, m * (-(-self.in_features // 64) * 64), m)
            self._lib.q8_rows_u8(x.data_ptr(), m, self.in_features, self.q.data_ptr(), self.scale.data_ptr(),
                                 where.data_ptr(), where.numel(), out.data_ptr(), xq, sx, torch.get_num_threads())
        elif out.numel():
            self._lib.q8_rows(x.data_ptr(), x.shape[0], self.in_features, self.q.data_ptr(), self.scale.data_ptr(),
                              where.data_ptr(), where.numel(), out.data_ptr(), torch.get_num_threads())
        return out

