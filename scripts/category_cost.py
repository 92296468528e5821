"""Where a short answer's time goes, per stack: the built-in questions of one category, each
answered ``--runs`` times by every stack in turn (interleaved), with the wall time and the parts
the engine times (prefill, draft core, router, target body, verification head, bookkeeping), and
the median wall time of each answer against the first stack's. For categories whose answers take
half a second, where ``dynaspec bench`` measures the machine's neighbours almost as much as the
stack.

    python scripts/category_cost.py --category translation --stacks default qwen-baseline --runs 4
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--category", required=True, help="a category of the built-in questions")
    parser.add_argument("--stacks", nargs="+", required=True, help="stacks (the first is the reference)")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.evaluation.bench import parse_questions
    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(args.threads)
    questions = [q for q in parse_questions(None) if q.category == args.category]
    if not questions:
        known = sorted({q.category for q in parse_questions(None)})
        parser.error(f"no built-in question in category {args.category!r}; categories: {', '.join(known)}")
    engines = Engine.from_stacks(args.stacks)
    for q in questions:
        walls: dict[str, list[float]] = {e.stack.name: [] for e in engines}
        for _ in range(args.runs):
            for engine in engines:
                ids = engine.target.format_prompt(q.turns[0])
                start = time.perf_counter()
                result = engine.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0)
                walls[engine.stack.name].append(time.perf_counter() - start)
                parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result.stats.times.items() if v)
                print(f"{q.question_id} {engine.stack.name}: {len(result.token_ids)} tokens, "
                      f"{walls[engine.stack.name][-1] * 1e3:.0f} ms, {result.stats.cycles} cycles "
                      f"({result.stats.plain_cycles} plain); ms: {parts}")
        first = statistics.median(walls[engines[0].stack.name])
        summary = ", ".join(f"{name} {statistics.median(w) * 1e3:.0f} ms ({first / statistics.median(w):.2f}x)"
                            for name, w in walls.items())
        print(f"{q.question_id} median wall time (speed against {engines[0].stack.name}): {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
