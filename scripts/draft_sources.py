"""Where a composite stack's tokens come from: for each of its drafters, the cycles it drafted, the
drafted tokens it had accepted per cycle, its tree's nodes and the depth its drafts reached; and
the cycles the cost planner took as plain steps. Greedy, train prompts from --first on (never
trained on), in the target's prompt format.

    python scripts/draft_sources.py --stack default --prompts 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import collections
import itertools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--first", type=int, default=None,
                        help="the first train prompt (default: where `dynaspec eval --split train` starts, "
                        "10,000, never trained on)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime import drafters
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.stats import GenerationStats
    from dynaspec.training.data import SELECTION_OFFSET, training_prompts

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    names = [type(s).__name__ for s in getattr(engine.source, "sources", [engine.source])]
    last: dict = {"source": None, "nodes": 0}
    grow = drafters._CompositeSession.grow

    def traced(self, *a, **k):  # which drafter the composite took this cycle
        counts = dict(a[6].draft_sources)
        tree = grow(self, *a, **k)
        changed = [i for i, c in a[6].draft_sources.items() if c != counts.get(i, 0)]
        last["source"], last["nodes"] = (changed[0] if changed else None), len(tree) - 1
        return tree

    record = GenerationStats.record_acceptance
    seen = collections.defaultdict(lambda: [0, 0, 0, 0])  # cycles, accepted, nodes, depth reached

    def recorded(self, depth, accepted):
        entry = seen[last["source"]]
        entry[0] += 1
        entry[1] += accepted
        entry[2] += last["nodes"]
        entry[3] += depth
        return record(self, depth, accepted)

    drafters._CompositeSession.grow = traced
    GenerationStats.record_acceptance = recorded
    cycles = plain = tokens = 0
    first = SELECTION_OFFSET if args.first is None else args.first
    items = itertools.islice(training_prompts(), first, first + args.prompts)
    for item in items:
        result = engine.generate(engine.target.format_prompt(item["text"]), max_new_tokens=args.new_tokens)
        cycles += len(result.stats.accepted_lengths)
        plain += result.stats.plain_cycles
        tokens += sum(result.stats.accepted_lengths)
    print(f"{args.stack}: {args.prompts} prompts, {cycles} cycles ({plain} plain steps), "
          f"{tokens / max(cycles, 1):.3f} tokens a cycle")
    for source, (count, accepted, nodes, depth) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        name = names[source] if isinstance(source, int) and source < len(names) else "?"
        print(f"  {name:<16} {count:5d} cycles  accepted drafts {accepted / count:.3f} a cycle  "
              f"tree nodes {nodes / count:.2f}  depth reached {depth / count:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
