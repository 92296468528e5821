"""``dynaspec eval-shortlist``: offline shortlist quality on held-out (dev) shards.

For every position of the target's own greedy continuation (whose next token is the target's
greedy choice, so the label is exact) and every draft depth ``t``, the shortlister proposes a
shortlist from what it would see at depth ``t`` of a chain whose earlier drafts were right:
``E(x_p)`` and the drafter's ``t``-times self-fed prediction of ``f_{p-1}`` (the target's true
feature at ``t = 0``). Recall is the fraction of next tokens inside the shortlist; it is reported
per depth and per slice against the average shortlist size, as a table and a PNG plot.

Recall is not the whole story: a shortlist can also drop the drafter's wrong favourite and so make
its draft right. So each position also gets the drafter's greedy draft inside the shortlist, and
greedy speculative decoding of the continuation with chains of ``depth`` drafts is replayed: each
cycle keeps the leading drafts that equal the target's tokens plus the target's own next token,
and the next cycle starts after them. The accepted length is tokens per cycle, as ``dynaspec eval``
reports it. (Deeper drafts read the drafter's self-fed features at every earlier position too,
where decoding has the target's true features for the committed ones: an approximation, the same
for every stack.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.types import DraftStep


@torch.no_grad()
def unrolled_features(drafter: Drafter, emb: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``out[t][p]`` is what depth ``t`` reads as ``H~`` at position ``p``: the true ``f_{p-1}`` at
    t = 0, else the drafter's prediction of it after ``t`` self-fed steps (rows for p >= 1)."""
    n = emb.shape[0]
    pos = torch.arange(1, n)[None]
    levels = [feats[:-1].float()]  # index j -> H~ for position j + 1
    inp = feats[:-1].float()
    for _ in range(depth):
        pred = drafter(emb[1:][None].float(), inp[None], pos)[0].float()  # pred[j] ~ f[j + 1]
        # the next level reads, at position j + 1, the prediction of f_j: pred[j - 1]
        inp = torch.cat([feats[:1].float(), pred[:-1]], dim=0)
        levels.append(inp)
    return levels


def evaluate_shortlisters(shards: Sequence[Path], target, drafter: Drafter, configs: dict[str, tuple[Any, Any]],
                          *, depth: int = 6, max_positions: int | None = None) -> dict[str, Any]:
    """``configs``: name -> (shortlister, scheduler). Returns recall and size per depth and slice."""
    from safetensors import safe_open
    from tqdm import tqdm

    from dynaspec.training.data import conversation_slice, load_conversations
    from dynaspec.training.shards import load_shard

    slices = {c["id"]: conversation_slice(c) for c in load_conversations()}
    acc: dict[str, dict[str, dict[int, list[float]]]] = {}
    chains: dict[str, dict[str, list[float]]] = {}  # name -> slice -> [tokens, cycles] of the replay
    weight = target.lm_head_weight
    seen = 0
    for path in tqdm(shards, desc="eval-shortlist", unit="shard", file=sys.stderr):
        shard = load_shard(path)
        with safe_open(str(path), framework="pt") as fh:
            ids = json.loads((fh.metadata() or {}).get("ids", "[]"))
        offs = shard["offsets"].tolist()
        for k, plen in enumerate(shard["prompt_lens"].tolist()):
            seq = shard["tokens"][offs[k]:offs[k + 1]].long()
            feats = shard["features"][offs[k]:offs[k + 1]]
            first = max(plen - 1, 1)
            if seq.numel() < first + 2:
                continue
            emb = target.embed(seq).float()
            levels = unrolled_features(drafter, emb, feats, depth)
            p = torch.arange(first, seq.numel() - 1)
            nxt = seq[p + 1]
            slice_name = slices.get(ids[k], "english") if k < len(ids) else "english"
            correct = {name: torch.zeros(depth, p.numel(), dtype=torch.bool) for name in configs}
            for t in range(depth):
                # the drafter's output at depth t for position q is levels[t + 1][q]
                out = levels[t + 1][p].to(weight.dtype)
                best = torch.cat([F.linear(c, weight).argmax(-1) for c in out.split(256)])
                # one row per step, as in a chain: a shortlister given several rows returns their
                # union (what a tree frontier needs), which is not one position's shortlist
                # the context is what decoding has committed: up to the cycle's root, t tokens back
                steps = [DraftStep(depth=t, tokens=seq[q], token_embeddings=emb[q], prev_hidden=levels[t][q - 1],
                                   context=seq[: max(int(q) - t + 1, 1)]) for q in p.split(1)]
                for name, (shortlister, scheduler) in configs.items():
                    hits, sizes = [], []
                    for row, step in enumerate(steps):
                        sl = shortlister.propose(step, scheduler)
                        if isinstance(sl, list):
                            sl = sl[0]
                        # the full-vocabulary favourite wins inside any shortlist that holds it
                        draft = best[row]
                        if sl.token_ids is None:
                            hits.append(1.0)
                            sizes.append(float(target.vocab_size))
                        else:
                            hits.append(float(bool((sl.token_ids == nxt[row]).any())))
                            sizes.append(float(sl.token_ids.numel()))
                            if not bool((sl.token_ids == draft).any()):
                                draft = sl.token_ids[F.linear(out[row], weight[sl.token_ids]).argmax()]
                        correct[name][t, row] = bool(draft == nxt[row])
                    for sl_name in ("overall", slice_name):
                        bucket = acc.setdefault(name, {}).setdefault(sl_name, {})
                        bucket.setdefault(t, [0.0, 0.0, 0.0])
                        bucket[t][0] += sum(hits)
                        bucket[t][1] += sum(sizes)
                        bucket[t][2] += len(hits)
            for name, c in correct.items():
                # decode the continuation as greedy speculative decoding does: a cycle after position
                # p[i] drafts depths 0, 1, ... (the depth-t draft is the one made at p[i + t]), keeps
                # the leading right drafts plus the target's own token, and the next cycle starts there
                tokens = cycles = i = 0
                while i + depth <= p.numel():
                    a = 0
                    while a < depth and c[a, i + a]:
                        a += 1
                    tokens, cycles, i = tokens + 1 + a, cycles + 1, i + 1 + a
                for sl_name in ("overall", slice_name):
                    total = chains.setdefault(name, {}).setdefault(sl_name, [0.0, 0.0])
                    total[0] += tokens
                    total[1] += cycles
            seen += p.numel()
            if max_positions and seen >= max_positions:
                break
        if max_positions and seen >= max_positions:
            break
    report: dict[str, Any] = {}
    for name, per_slice in acc.items():
        report[name] = {}
        for sl_name, per_depth in per_slice.items():
            rows = {t: {"recall": v[0] / v[2], "size": v[1] / v[2], "positions": int(v[2])}
                    for t, v in sorted(per_depth.items())}
            total = chains.get(name, {}).get(sl_name, [0.0, 0.0])
            report[name][sl_name] = {
                "per_depth": rows,
                "mean_recall": sum(r["recall"] for r in rows.values()) / len(rows),
                "mean_size": sum(r["size"] for r in rows.values()) / len(rows),
                "chain_accepted_length": total[0] / total[1] if total[1] else None,
                "cycles": int(total[1]),
            }
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = ["| shortlister | slice | mean size | mean recall | replayed accepted length | "
             "recall per depth |", "|---|---|---|---|---|---|"]
    for name, per_slice in report.items():
        for sl_name, f in per_slice.items():
            depths = " ".join(f"{r['recall']:.3f}@{r['size']:,.0f}" for r in f["per_depth"].values())
            al = f.get("chain_accepted_length")
            al_text = f"{al:.3f}" if al is not None else "-"
            lines.append(f"| {name} | {sl_name} | {f['mean_size']:,.0f} | {f['mean_recall']:.4f} | {al_text} | "
                         f"{depths} |")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path, slice_name: str = "overall") -> None:
    from dynaspec.evaluation.plots import figure

    with figure(path, size=(7, 4.5), xlabel="average shortlist size (tokens)",
                ylabel="recall of the target's next token", xlog=True, grid=True,
                title=f"shortlist recall vs size ({slice_name}, dev)") as ax:
        for name, per_slice in report.items():
            f = per_slice.get(slice_name)
            if f:
                ax.scatter([f["mean_size"]], [f["mean_recall"]], label=name)
                ax.annotate(name, (f["mean_size"], f["mean_recall"]), fontsize=7)


def run(stacks: list[str], work: list[str], out: Path, *, depth: int = 6,
        max_positions: int | None = None) -> dict[str, Any]:
    """``dynaspec eval-shortlist``: the report of :func:`evaluate_shortlisters` for ``stacks`` on the
    dev shards of ``work``, printed, and written to ``out`` as JSON and PNG."""
    from dynaspec.errors import ConfigError
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.files import atomic_write
    from dynaspec.training.shards import shard_paths

    shards = [p for folder in work for p in shard_paths(folder)]
    if not shards:
        raise ConfigError(f"no shards in {' '.join(work)}: collect dev shards with "
                          "`dynaspec train-drafter --stage collect --split dev --work DIR`")
    configs, target, drafter = {}, None, None
    # offline analysis of the shortlists: float32 throughout, whatever the stacks run in
    for engine in Engine.from_stacks(stacks, overrides={"dtype": "float32"}):
        target, drafter = engine.target, engine.drafter or drafter
        configs[engine.stack.name] = (engine.shortlister, engine.scheduler)
    report = evaluate_shortlisters(shards, target, drafter.float(), configs, depth=depth,
                                   max_positions=max_positions)
    print(format_report(report))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "shortlist_eval.json", lambda p: Path(p).write_text(json.dumps(report, indent=2)))
    plot_report(report, out / "recall_vs_size.png")
    print(f"wrote {out / 'shortlist_eval.json'} and {out / 'recall_vs_size.png'}", file=sys.stderr)
    return report
