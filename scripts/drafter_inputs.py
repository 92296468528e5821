"""How large each of a drafter's two inputs is where they meet: ``fc([E(x), f])`` is one product of
the token embedding and the target's features, so the share of its output that each half gives is
the share of the drafter's attention the token and the context get. Measured on the positions of a
collected shard (the token after each position beside that position's features), per drafter:

    python scripts/drafter_inputs.py --target qwen2.5-coder-0.5b --work qwen-select \\
        --drafter qwen2.5-coder-0.5b OTHER_DRAFTER

Columns: the RMS of a token embedding (median over the vocabulary, as ``target.embed`` gives it),
the RMS of the target's final normed hidden state, and the RMS of ``fc``'s token part and feature
part over the shard's positions (the token part after the drafter's embedding norm, where it has
one: ``DrafterConfig.embed_norm``). Session 30 found Qwen2.5-Coder's token part a tenth of its
feature part (embeddings of RMS 0.017 beside features of 6.4), Gemma's balanced.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def fc_parts(drafter, embeddings, features):
    """RMS of ``fc``'s token part and feature part for these inputs ([N, d] and [N, k*d])."""
    import torch

    d = drafter.cfg.hidden_size
    weight = drafter.fc.weight.float()
    with torch.no_grad():
        tokens = drafter.token_input(embeddings.float()).float()
        feats = drafter.project(features.float()).float()
        token_part, feature_part = tokens @ weight[:, :d].T, feats @ weight[:, d:].T
    return float(token_part.pow(2).mean().sqrt()), float(feature_part.pow(2).mean().sqrt())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--work", required=True, help="a folder of collected shards")
    parser.add_argument("--drafter", nargs="+", required=True, help="built-in names or folders")
    parser.add_argument("--shard", type=int, default=0, help="which shard of --work (default: the first)")
    parser.add_argument("--positions", type=int, default=2000, help="at most this many positions")
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.targets import load_drafter, load_target
    from dynaspec.training.drafter import _layer_inputs, embedding_rms
    from dynaspec.training.shards import load_shard, shard_paths

    torch.set_num_threads(1)
    target = load_target(args.target)
    paths = shard_paths(Path(args.work))
    if not paths:
        raise SystemExit(f"no shards in {args.work}")
    if not 0 <= args.shard < len(paths):
        raise SystemExit(f"--shard {args.shard}: {args.work} has {len(paths)} shards")
    path = paths[args.shard]
    print(f"token embedding RMS (median over the vocabulary): {embedding_rms(target):.4f}")
    print("| drafter | final hidden state RMS | fc token part RMS | fc feature part RMS | token / feature |")
    print("|---|---|---|---|---|")
    for ref in args.drafter:
        drafter = load_drafter(ref, target).float()
        lower = tuple(drafter.feature_layers[:-1]) if drafter.feature_layers else ()
        _layer_inputs(target, [path], lower)
        shard = load_shard(path, lower)
        offsets = shard["offsets"].tolist()
        # each position p beside the token after it, within one sequence
        here = torch.cat([torch.arange(a, b - 1) for a, b in zip(offsets[:-1], offsets[1:])])[: args.positions]
        final = shard["features"][here].float()
        feats = torch.cat([shard["layer_inputs"][here].float(), final], dim=-1) if lower else final
        emb = target.embed(shard["tokens"][here + 1].long().to(target.device)).float()
        token_rms, feature_rms = fc_parts(drafter, emb, feats)
        print(f"| {Path(ref).name} | {final.pow(2).mean().sqrt():.3f} | {token_rms:.3f} | {feature_rms:.3f} | "
              f"{token_rms / feature_rms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
