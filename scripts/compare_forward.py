"""Side by side: the target's forwards and kernels, end to end, on one loaded target.

For each dev-protocol prompt, plain decoding (``baseline``) and a speculative stack run under
three settings of the same target, interleaved prompt by prompt so that machine noise hits all
alike:

- ``generic``: the Hugging Face modules, on the stock kernels (the forward before the lean one);
- ``lean, observed``: the lean forward, on the kernels of ``exact = "observed"`` (no padding);
- ``lean, required``: the lean forward, on the kernels of ``exact = "required"`` (the default:
  padded where the numerics probe found that only padding makes them batch-invariant).

Prints the median tokens/s of each, the speed-up of the stack over plain decoding under the same
setting, the median time of a plain step (target body and head), the numerics verdict, and
whether every output equals plain decoding under the same setting and under ``generic``.

    python scripts/compare_forward.py --stack default --prompts 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default", help="the speculative stack (default: default)")
    parser.add_argument("--prompts", type=int, default=8, help="dev-protocol prompts (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="override the stack's dtype (float32, bfloat16)")
    parser.add_argument("--json-out", default=None, help="write the per-prompt figures here")
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.engine import Engine
    from dynaspec.training.data import dev_protocol_prompts

    torch.set_num_threads(args.threads)
    overrides = {"dtype": args.dtype} if args.dtype else None
    engines = {}
    for exact in ("required", "observed"):
        changes = {**(overrides or {}), "exact": exact}
        spec = Engine.from_stack(args.stack, overrides=changes, target=engines.get("target"))
        engines["target"] = target = spec.target
        plain = Engine.from_stack("baseline", overrides={"target": spec.stack.target, **changes}, target=target)
        engines[exact] = (plain, spec)
    print(f"target {target.name}, {str(target.dtype).removeprefix('torch.')}, {args.threads} thread(s); "
          f"numerics verdict: {json.dumps(target.batch_invariance)}", file=sys.stderr)
    settings = {"generic": ("generic", "observed"), "lean, observed": ("lean", "observed"),
                "lean, required": ("lean", "required")}
    rows = []
    for k, item in enumerate(dev_protocol_prompts(args.prompts)):
        prompt = target.format_prompt(item["text"])
        row = {"prompt": k, "slice": item["slice"]}
        outputs = {}
        for setting, (kind, exact) in settings.items():
            target.forward_kind = kind
            for name, engine in zip(("baseline", "spec"), engines[exact]):
                result = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
                outputs[(setting, name)] = result.token_ids
                row[f"{setting}/{name}"] = result.stats.tokens_per_second
                if name == "baseline":
                    row[f"{setting}/step_ms"] = 1e3 * statistics.median(result.stats.verify_times)
                else:
                    row[f"{setting}/exactness"] = result.stats.exactness
            row[f"{setting}/exact"] = outputs[(setting, "spec")] == outputs[(setting, "baseline")]
            row[f"{setting}/same_as_generic"] = outputs[(setting, "baseline")] == outputs[("generic", "baseline")]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    target.forward_kind = "lean"

    def med(key):
        return statistics.median(r[key] for r in rows)

    print(f"| setting | plain tokens/s | `{args.stack}` tokens/s | speed-up | plain step (target), ms | "
          "exactness | output = its plain decoding | plain = generic plain |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in settings:
        print(f"| {setting} | {med(f'{setting}/baseline'):.2f} | {med(f'{setting}/spec'):.2f} | "
              f"{statistics.median(r[f'{setting}/spec'] / r[f'{setting}/baseline'] for r in rows):.2f}x | "
              f"{med(f'{setting}/step_ms'):.1f} | "
              f"{'not probed' if settings[setting][0] == 'generic' else rows[0][f'{setting}/exactness']} | "
              f"{sum(r[f'{setting}/exact'] for r in rows)}/{len(rows)} | "
              f"{sum(r[f'{setting}/same_as_generic'] for r in rows)}/{len(rows)} |")
    print(f"numerics verdict: {json.dumps(target.batch_invariance)}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
