"""Plain decoding with the int8 kernel's bfloat16 epilogue (AMX tiles write bfloat16 outputs
themselves) against the float32 outputs converted by torch afterwards, side by side: the same
questions, alternating which runs first, every output checked equal. Prints the median decoding
step and the prefills' total for each, and the median per-question ratio of steps.

    python scripts/epilogue_ab.py --stack qwen-baseline --questions docs/results/train-questions-s26.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="qwen-baseline")
    parser.add_argument("--questions", default="docs/results/train-questions-s26.jsonl",
                        help="Spec-Bench-format questions (first turns are the prompts)")
    parser.add_argument("--count", type=int, default=8, help="how many of them")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec import Engine
    from dynaspec.runtime import q8

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    with open(args.questions) as f:
        prompts = [json.loads(line)["turns"][0] for line in f if line.strip()][:args.count]
    engine.generate("Hello", max_new_tokens=8)
    steps = {"epilogue": [], "converted": []}
    prefills = {"epilogue": 0.0, "converted": 0.0}
    outputs = {}
    for round_ in range(args.rounds):
        for prompt in prompts:
            order = ("epilogue", "converted") if round_ % 2 == 0 else ("converted", "epilogue")
            for name in order:
                q8.BF16_EPILOGUE = name == "epilogue"
                r = engine.generate(prompt, max_new_tokens=args.new_tokens)
                if outputs.setdefault(prompt, r.token_ids) != r.token_ids:
                    raise SystemExit(f"outputs differ ({name}) on {prompt[:60]!r}")
                steps[name].append((r.stats.wall_time - r.stats.times["prefill"]) / max(1, r.stats.new_tokens - 1))
                prefills[name] += r.stats.times["prefill"]
    q8.BF16_EPILOGUE = True
    for name in steps:
        print(f"{name}: median step {statistics.median(steps[name]) * 1e3:.2f} ms, prefills {prefills[name]:.3f} s")
    ratio = statistics.median(c / e for c, e in zip(steps["converted"], steps["epilogue"]))
    print(f"step converted / epilogue (median over {len(steps['epilogue'])} generations): {ratio:.3f}; "
          f"prefills {prefills['converted'] / prefills['epilogue']:.3f}; every output identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
