"""Plain decoding (or any stack) with one of the int8 kernel's AMX changes on and off, side by
side: the same questions, alternating which runs first, every output checked equal. ``--switch
epilogue``: bfloat16 outputs written by the tiles' epilogue itself, against float32 outputs
converted by torch afterwards; ``--switch pairs``: groups of 16 rows in pairs (each weight tile
serving both), against one group at a time; ``--switch attend``: bfloat16 attention (q8.attend) on
AMX tiles against the AVX-512 vector code; ``--switch compiled-attend``: the lean forward's compiled
attention (q8.attend, AVX-512 or AVX2) against torch's attention row by row (both: two roundings of
attention, so outputs may differ, and are counted). Prints the median decoding step and the prefills'
total for each, and the median per-question ratio of steps. ``--lengths``: instead, the target's
prefill of token sequences of those lengths (median of 9 passes each way), the ratio per length.

    python scripts/kernel_ab.py --switch epilogue --stack qwen-baseline
    python scripts/kernel_ab.py --switch pairs --stack qwen-baseline --lengths 32 64 128 201 333
    python scripts/kernel_ab.py --switch attend --stack default
    python scripts/kernel_ab.py --switch compiled-attend --stack qwen-baseline
    python scripts/kernel_ab.py --switch elementwise --stack qwen-baseline

With a drafting stack the two ways share the engine's measured costs (the cost planner's plain
step and verification times): time plain decoding for the cleanest ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics

#: each switch's two ways, the change's first
NAMES = {"epilogue": ("epilogue", "converted"), "pairs": ("pairs", "alone"), "attend": ("tiles", "vector"),
         "compiled-attend": ("compiled", "torch"), "elementwise": ("compiled", "torch")}
#: the switches whose two ways are different roundings (outputs compared, not required equal)
ROUNDINGS = {"attend", "compiled-attend", "elementwise"}
#: the lean forward's compiled pieces that a switch turns off and on again
_PIECES = {"compiled-attend": ("_c_attend",), "elementwise": ("_c_rope", "_c_silu_mul", "_c_add_norm")}
#: for ``compiled-attend`` and ``elementwise``: the lean forward and those pieces (set by :func:`main`)
_LEAN: dict[str, object] = {}


def _switch(which: str, on: bool) -> None:
    """Turn the kernel change ``which`` on or off (the same bits either way, but for the roundings)."""
    from dynaspec.runtime import q8

    if which in _PIECES:
        for piece in _PIECES[which]:
            setattr(_LEAN["lean"], piece, _LEAN[piece] if on else None)
    elif which == "epilogue":
        q8.BF16_EPILOGUE = on
    elif which == "attend":
        q8.set_amx_attend(on)
    else:
        q8.set_amx_pairs(on)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="qwen-baseline")
    parser.add_argument("--questions", default="docs/results/train-questions-s26.jsonl",
                        help="Spec-Bench-format questions (first turns are the prompts)")
    parser.add_argument("--count", type=int, default=8, help="how many of them")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--switch", choices=sorted(NAMES), default="epilogue")
    parser.add_argument("--prefill-only", action="store_true", help="generate one token (time the prefills)")
    parser.add_argument("--lengths", type=int, nargs="+", help="time prefills of these many tokens instead")
    args = parser.parse_args(argv)

    import torch

    from dynaspec import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    if args.switch in _PIECES:
        lean = getattr(engine.target, "_lean", None)
        if lean is None or any(getattr(lean, piece) is None for piece in _PIECES[args.switch]):
            raise SystemExit(f"{args.stack}: its target does not run {args.switch!r} through the compiled kernel "
                             "here (it needs the int8 or w8a8 weights, and for the attention AVX-512 or AVX2)")
        _LEAN.update(lean=lean, **{piece: getattr(lean, piece) for piece in _PIECES[args.switch]})
    if args.lengths:
        return _prefills(engine.target, args)
    with open(args.questions) as f:
        prompts = [json.loads(line)["turns"][0] for line in f if line.strip()][:args.count]
    engine.generate("Hello", max_new_tokens=8)
    new, old = NAMES[args.switch]
    steps = {new: [], old: []}
    prefills = {new: 0.0, old: 0.0}
    outputs: dict[tuple[str, str], list[int]] = {}
    tokens = 1 if args.prefill_only else args.new_tokens
    for round_ in range(args.rounds):
        for prompt in prompts:
            order = (new, old) if round_ % 2 == 0 else (old, new)
            for name in order:
                _switch(args.switch, name == new)
                r = engine.generate(prompt, max_new_tokens=tokens)
                key = (prompt, name if args.switch in ROUNDINGS else "")
                if outputs.setdefault(key, r.token_ids) != r.token_ids:
                    raise SystemExit(f"outputs differ ({name}) on {prompt[:60]!r}")
                steps[name].append((r.stats.wall_time - r.stats.times["prefill"]) / max(1, r.stats.new_tokens - 1))
                prefills[name] += r.stats.times["prefill"]
    _switch(args.switch, True)
    for name in steps:
        print(f"{name}: median step {statistics.median(steps[name]) * 1e3:.2f} ms, prefills {prefills[name]:.3f} s")
    ratio = statistics.median(o / n for o, n in zip(steps[old], steps[new])) if not args.prefill_only else float("nan")
    if args.switch in ROUNDINGS:
        same = sum(outputs[(p, new)] == outputs[(p, old)] for p in prompts)
        told = f"each way's outputs the same in every round; {same} of {len(prompts)} the same both ways"
    else:
        told = "every output identical"
    print(f"step {old} / {new} (median over {len(steps[new])} generations): {ratio:.3f}; "
          f"prefills {prefills[old] / prefills[new]:.3f}; {told}")
    return 0


def _prefills(target, args) -> int:
    import time

    import torch

    new, old = NAMES[args.switch]
    print(f"| prompt tokens | {new}, ms | {old}, ms | {old} / {new} |")
    print("|---|---|---|---|")
    for n in args.lengths:
        ids = torch.arange(1000, 1000 + n) % target.vocab_size
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for round_ in range(3):
            for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                _switch(args.switch, on)
                for _ in range(3):
                    start = time.perf_counter()
                    hidden = target.forward(ids, torch.arange(n), target.new_cache())
                    times[on].append(time.perf_counter() - start)
                    if not torch.equal(outs.setdefault(on, hidden), hidden):
                        raise SystemExit("a prefill gave other hidden states on a second pass")
        _switch(args.switch, True)
        if args.switch not in ROUNDINGS and not torch.equal(outs[True], outs[False]):
            raise SystemExit(f"the two ways gave other hidden states at {n} tokens")
        a, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |")
    print("the hidden states of both ways identical at every length" if args.switch not in ROUNDINGS
          else "each way's hidden states the same on every pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
