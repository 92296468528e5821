"""Where a warm start goes: the seconds from a fresh process to the first token, by stage.

Times, in one process (run it twice: the first run on a machine converts the target and builds
the kernel; the second is the warm start issue 26 asks to bring under 3 s): importing torch,
transformers and dynaspec, ``Engine.from_stack`` (with ``--profile``, its slowest calls by
cumulative time), and the first token of a short prompt.

    python scripts/start_cost.py --stack default --threads 1
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N slowest calls of building the engine (cProfile, cumulative)")
    args = parser.parse_args(argv)
    marks = [("start", time.perf_counter())]
    import torch

    marks.append(("import torch", time.perf_counter()))
    torch.set_num_threads(args.threads)
    from dynaspec.runtime.engine import Engine

    marks.append(("import dynaspec", time.perf_counter()))
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    engine = Engine.from_stack(args.stack)
    if profiler is not None:
        profiler.disable()
    marks.append(("Engine.from_stack", time.perf_counter()))
    target = engine.target
    engine.generate(target.tokenizer(target.format_prompt("Hi"))["input_ids"], max_new_tokens=1)
    marks.append(("first token", time.perf_counter()))
    for (_, before), (name, at) in zip(marks, marks[1:]):
        print(f"{name:>20}: {at - before:6.2f} s")
    print(f"{'total':>20}: {marks[-1][1] - marks[0][1]:6.2f} s")
    import sys

    print(f"transformers imported: {'yes' if 'transformers' in sys.modules else 'no'}; target "
          f"{'mapped from its image ' + str(target.image) if getattr(target, 'image', None) else 'loaded in full'}")
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
