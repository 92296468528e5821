"""The compiled attention (``q8.attend``) by rows, in C and through its Python wrapper.

Rows over the last ``--keys`` entries of a bfloat16 KV buffer, each row up to its own position
(a chain's rows), with Qwen2.5-0.5B's heads by default (14 query heads on 2 kv heads, 64 wide);
median of ``--repeats`` calls, in microseconds. On AMX tiles where the processor has them
(``DYNASPEC_Q8_AMX_ATTEND=0``: the AVX-512 vector code).

    python scripts/attend_bench.py --keys 400
    DYNASPEC_Q8_AMX_ATTEND=0 python scripts/attend_bench.py --keys 400
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime import q8

    lib = q8._library()
    capacity = args.keys + 64
    kbuf = torch.randn(1, args.kv_heads, capacity, args.head_dim).bfloat16()
    vbuf = torch.randn(1, args.kv_heads, capacity, args.head_dim).bfloat16()
    keys, values = kbuf[:, :, :args.keys], vbuf[:, :, :args.keys]
    scale = args.head_dim ** -0.5
    way = "AMX tiles" if q8.attention_on_tiles() else q8.isa()
    print(f"q8.attend ({way}), bfloat16, {args.heads} heads on {args.kv_heads}, {args.head_dim} wide, "
          f"{args.keys} keys; median of {args.repeats}, us")
    print("| rows | C call | with the Python wrapper |")
    print("|---|---|---|")
    for t in args.rows:
        q = torch.randn(t, args.heads, args.head_dim).bfloat16()
        ends = list(range(args.keys - t + 1, args.keys + 1))
        end = (ctypes.c_int64 * t)(*ends)
        start = (ctypes.c_int64 * t)(*([0] * t))
        out = torch.empty(t, args.heads * args.head_dim, dtype=torch.bfloat16)
        c_times, py_times = [], []
        for _ in range(args.repeats):
            began = time.perf_counter()
            lib.q8_attend(q.data_ptr(), 1, t, args.heads, args.kv_heads, args.head_dim, q.stride(0),
                          keys.data_ptr(), values.data_ptr(), keys.stride(1), keys.stride(2), start, end,
                          None, None, 0, scale, out.data_ptr())
            c_times.append(time.perf_counter() - began)
            began = time.perf_counter()
            q8.attend(q, keys, values, ends, scale, lib=lib)
            py_times.append(time.perf_counter() - began)
        print(f"| {t} | {1e6 * statistics.median(c_times):.1f} | {1e6 * statistics.median(py_times):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
