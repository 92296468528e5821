"""A drafter's accepted length on collected held-out shards, offline: for every answer position of
every sequence, the chain the drafter drafts there (greedy, full vocabulary, its own tokens and
features fed back, exactly as the engine's chain drafts) is compared with the target's own greedy
continuation stored in the shard. No target forward runs, so it takes a minute where `dynaspec eval`
takes an hour; it measures the drafter alone (no shortlist, no confidence stop, no n-gram drafter).

    dynaspec train-drafter --target qwen2.5-coder-0.5b --stage collect --split dev --prompts 64 \\
        --work dev-shards --feature-layers 3 12
    python scripts/drafter_offline.py --target qwen2.5-coder-0.5b --work dev-shards \\
        --drafter qwen2.5-coder-0.5b other/drafter --depth 5 --every 2

Prints, per drafter, the mean accepted length of a chain of ``--depth``: tokens committed per cycle,
the target's own one included, as `dynaspec eval` counts it; and the conditional acceptance at each
draft position (of the chains that reached it, the share whose token there was the target's).
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.inference_mode()
def chain_acceptance(target, drafter, shard: dict, depth: int, every: int, topk: int = 0) -> dict:
    """Per draft position: chains that reached it and chains whose token there was the target's;
    with ``topk``, also how often the target's token at the first draft position is among the
    drafter's ``k`` likeliest there, for k = 1..topk (what sibling branches of a tree could catch)."""
    from dynaspec.runtime.drafter import DraftCache

    head = target.lm_head_weight
    dtype = drafter.fc.weight.dtype
    reached, accepted, lengths = [0] * depth, [0] * depth, []
    top_hits = torch.zeros(topk)
    offs, plens = shard["offsets"].tolist(), shard["prompt_lens"].tolist()
    lower = shard.get("layer_inputs")
    for a, b, plen in zip(offs[:-1], offs[1:], plens):
        toks = shard["tokens"][a:b].long()
        feats = shard["features"][a:b]
        if lower is not None and drafter.feature_layers is not None:
            feats = torch.cat([lower[a:b], feats], dim=-1)
        n = len(toks)
        # the target's greedy next token after each position, from its own stored final state
        gold = (feats[:, -target.hidden_size:].to(head.dtype) @ head.T).argmax(-1)  # gold[i]: token i+1
        cache = DraftCache(n + depth + 1)
        emb = target.embed(toks[1:]).to(dtype)
        # one pass over the sequence: entry i of the cache holds token i+1 (read with feature i)
        outs = drafter(emb[None], drafter.project(feats[:-1].to(dtype))[None],
                       torch.arange(1, n)[None], cache=cache)[0]
        roots = list(range(plen - 1, n - 1, every))
        if topk and roots:
            at = torch.tensor(roots)
            ranked = (outs[at - 1].to(head.dtype) @ head.T).topk(topk, dim=-1).indices
            top_hits += (ranked == gold[at][:, None]).float().cumsum(-1).sum(0)
        for m in reversed(roots):  # later roots first: each overwrites only cache entries past it
            cache.crop(m)  # entries for tokens 1..m: the committed context of root m
            out = outs[m - 1:m]  # predicted f_m from (x_m, f_{m-1})
            ok = 0
            for k in range(depth):
                if m + k + 1 >= n:
                    break
                tok = int((out[-1].to(head.dtype) @ head.T).argmax())
                reached[k] += 1
                if tok != int(gold[m + k]):
                    break
                accepted[k] += 1
                ok += 1
                out = drafter(target.embed(torch.tensor([tok])).to(dtype)[None], out[None],
                              torch.tensor([[m + k + 1]]), cache=cache)[0]
            lengths.append(ok)
    return {"reached": reached, "accepted": accepted, "lengths": lengths, "top_hits": top_hits.tolist()}


def main() -> None:
    from dynaspec.runtime.targets import load_drafter, load_target
    from dynaspec.training.drafter import lower_layers
    from dynaspec.training.shards import load_shard, shard_paths

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--work", required=True, help="a folder of collected held-out (dev) shards")
    ap.add_argument("--drafter", nargs="+", required=True, help="built-in names or folders")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--every", type=int, default=1, help="draft from every N-th answer position")
    ap.add_argument("--topk", type=int, default=0, metavar="K",
                    help="also report the first draft position's top-1..K hit rates")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target).to(dtype=torch.float32)
    paths = shard_paths(args.work)
    if not paths:
        raise SystemExit(f"no shards in {args.work}")
    report = {}
    for ref in args.drafter:
        drafter = load_drafter(ref, target).float()
        layers = lower_layers(target, drafter.feature_layers[:-1] if drafter.feature_layers else ())
        totals = {"reached": [0] * args.depth, "accepted": [0] * args.depth, "lengths": [],
                  "top_hits": [0.0] * args.topk}
        for path in paths:
            one = chain_acceptance(target, drafter, load_shard(path, layers), args.depth, args.every, args.topk)
            for key in ("reached", "accepted", "top_hits"):
                totals[key] = [x + y for x, y in zip(totals[key], one[key])]
            totals["lengths"] += one["lengths"]
        mean = 1 + sum(totals["lengths"]) / max(len(totals["lengths"]), 1)  # + the target's own token
        cond = [round(a / r, 3) if r else None for a, r in zip(totals["accepted"], totals["reached"])]
        report[ref] = {"mean_accepted_length": round(mean, 3), "chains": len(totals["lengths"]),
                       "conditional_acceptance": cond}
        print(f"{ref}: accepted length {mean:.3f} over {len(totals['lengths'])} chains of {args.depth}; "
              f"per position {cond}", flush=True)
        if args.topk:
            report[ref]["first_position_top_k"] = [round(h / max(len(totals["lengths"]), 1), 3)
                                                   for h in totals["top_hits"]]
            print(f"{ref}: first position's top-1..{args.topk} hit rate {report[ref]['first_position_top_k']}",
                  flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"target": args.target, "work": args.work, "depth": args.depth, "every": args.every,
                       "topk": args.topk,
                       "drafters": report}, fh, indent=2)


if __name__ == "__main__":
    main()
