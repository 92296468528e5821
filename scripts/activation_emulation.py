"""Which products 8-bit activations hurt: ``weights_quality.py`` with emulated int8 activations.

Runs ``scripts/weights_quality.py --weights int8,int8`` with the second setting's activations
rounded to int8 (per row, or per block of ``--block`` columns; each with its largest magnitude /
127, the ``w8a8`` kernel's rounding) before they enter the ``int8`` kernel, except the products
named by ``--keep`` (``OUTxIN`` shapes or input widths), which keep the kernel's int16 activations.
The first setting (the reference) is plain ``int8``. An experiment, not a weights setting: what a
per-product or per-block variant of ``w8a8`` would keep in quality, before building its kernel.

    python scripts/activation_emulation.py --keep 2048 -- --target gemma3-270m --texts 16 --prompts 12

Everything after ``--`` goes to ``weights_quality.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", default="", help="comma-separated products kept at int16 activations: OUTxIN "
                        "shapes (262144x640) or input widths (2048)")
    parser.add_argument("--block", type=int, default=0, help="columns per activation scale (0: one per row)")
    args = parser.parse_args(own)
    keep = {k for k in args.keep.split(",") if k}

    sys.path.insert(0, str(Path(__file__).parent))
    import weights_quality

    from dynaspec.runtime import q8

    def rounded(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        k = xf.shape[-1]
        blocks = xf.reshape(*xf.shape[:-1], k // args.block, args.block) if args.block and k % args.block == 0 \
            else xf.unsqueeze(-2)
        amax = blocks.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return (torch.round(blocks / scale).clamp(-127, 127) * scale).reshape(xf.shape).to(x.dtype)

    active = [False]
    kernel_call = q8.Int8WeightLinear.__call__

    def call(self, x):
        kept = str(self.in_features) in keep or f"{self.out_features}x{self.in_features}" in keep
        return kernel_call(self, rounded(x) if active[0] and not kept else x)

    loads = [0]
    load = weights_quality.load

    def counted_load(*a):
        active[0] = loads[0] > 0  # the first setting loaded is the reference
        loads[0] += 1
        return load(*a)

    q8.Int8WeightLinear.__call__ = call
    weights_quality.load = counted_load
    return weights_quality.main(["--weights", "int8,int8", *rest])


if __name__ == "__main__":
    raise SystemExit(main())
