"""Product cost and batch invariance by row count, for a target's own shapes, on this machine.

For every distinct product of the lean forward (fused QKV, O, fused gate-up, down) and the LM head,
in the target's dtype: the median time of ``F.linear`` on 1, 2, 3, 4, 6 and 8 rows, and which row
counts compute a row alike (classes of row counts whose shared rows are bit for bit equal). Where
one row is a class of its own, plain steps and verifications round differently unless the
numerics probe pads (see ``dynaspec.runtime.batch_invariance``); the times say what padding costs.

    python scripts/rows_cost.py --target gemma3-270m --dtype float32 --threads 1

``--kernel float16`` or ``--kernel int8`` times the products of ``weights = "float16"`` and of
the int8 head instead (``dynaspec.runtime.quantized``), on the same weights; with ``--kernel int8``,
``--mode`` picks how its activations enter the products (``dynaspec.runtime.q8.MODES``).
``--from-memory`` times each product over every layer's weights in turn, so that they come from
memory as in a forward, not from the cache (one product at a time keeps a layer's weights cached).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernel", default="float", choices=["float", "float16", "int8"],
                        help="float: F.linear in the dtype; float16 / int8: the quantised kernels")
    parser.add_argument("--mode", choices=["float", "int16", "int8"],
                        help="with --kernel int8: the activations' precision (default: the kernel's default)")
    parser.add_argument("--from-memory", action="store_true",
                        help="cycle through every layer's weights of each product (as a forward reads them)")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from dynaspec.runtime.targets import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target).to(dtype=args.dtype)
    lean = target._lean_decoder()
    count = len(lean.layers) if args.from_memory else 1
    layers = target.decoder.layers
    shapes = {"qkv": [lean.layers[i].qkv_weight for i in range(count)],
              "o": [layers[i].self_attn.o_proj.weight for i in range(count)],
              "gate-up": [lean.layers[i].gate_up_weight for i in range(count)],
              "down": [layers[i].mlp.down_proj.weight for i in range(count)],
              "lm head": [target.lm_head_weight]}
    rows = (1, 2, 3, 4, 6, 8)
    gen = torch.Generator().manual_seed(0)
    print(f"{target.name}, {args.dtype}, {args.kernel} kernel{f' ({args.mode})' if args.mode else ''}, {args.threads} thread(s), "
          f"{torch.backends.cpu.get_cpu_capability()}, weights {'from memory' if args.from_memory else 'cached'}")
    print("| product | shape | " + " | ".join(f"{r} row{'s' if r > 1 else ''}, ms" for r in rows)
          + " | row counts that agree (1..16) |")
    print("|---|---|" + "---|" * len(rows) + "---|")
    with torch.inference_mode():
        for name, weights in shapes.items():
            weight = weights[0]
            x = torch.randn(16, weight.shape[1], generator=gen).to(weight.dtype)

            def make(w):
                if args.kernel == "float":
                    return functools.partial(F.linear, weight=w)
                if args.kernel == "int8" and args.mode:
                    from dynaspec.runtime.q8 import Int8WeightLinear

                    return Int8WeightLinear(w, mode=args.mode)
                from dynaspec.runtime.quantized import make_kernel

                return make_kernel(args.kernel, w)

            products = [make(w) for w in weights]
            product = products[0]
            times = []
            for r in rows:
                samples = []
                for _ in range(args.repeats):
                    for each in products:
                        start = time.perf_counter()
                        each(x[:r])
                        samples.append(time.perf_counter() - start)
                times.append(1e3 * statistics.median(samples))
            out = {m: product(x[:m]) for m in range(1, 17)}
            classes: list[list[int]] = []
            for m in range(1, 17):
                for cls in classes:
                    n = min(m, cls[0])
                    if torch.equal(out[m][:n], out[cls[0]][:n]):
                        cls.append(m)
                        break
                else:
                    classes.append([m])
            described = " ".join("{" + (f"{c[0]}..{c[-1]}" if len(c) > 2 and c == list(range(c[0], c[-1] + 1))
                                        else ",".join(map(str, c))) + "}" for c in classes)
            print(f"| {name} | {weight.shape[0]}x{weight.shape[1]} | " + " | ".join(f"{t:.2f}" for t in times)
                  + f" | {described} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
