"""``dynaspec train-router``: train the DynaSpec router on collected ShareGPT-train shards.

Examples come from the shards written by ``dynaspec train-drafter --stage collect``: at position
``p`` the router reads ``(E(x_p), h_{p-1})`` and must put the target's greedy next token into the
top clusters — ``x_{p+1}`` of the target's own continuations, or the stored ``teacher`` token
everywhere in raw-text shards (``--source raw``). ``h_{p-1}`` is the target's feature (what draft
depth 0 sees) or, for a second copy of each example, the drafter's own prediction of it (what
deeper draft steps see). The loss is the
cross-entropy on the cluster of the next token; recall at several budgets is reported on held-out
shards. Checkpoints and the final router are written atomically as safetensors.

With ``core_ids`` (``--core N --frequency LIST``) the router is trained for the ``hybrid`` shortlister:
its clusters no longer hold the always-on core, so it gets one more class, "the next token is in the
core", and the cluster classes only have to find the tokens the core misses.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dynaspec.runtime.drafter import Drafter
from dynaspec.shortlisters.router import Router, RouterConfig, cluster_digest, core_digest
from dynaspec.training import distributed


@torch.no_grad()
def router_examples(shard: dict[str, torch.Tensor], embed, assignment: torch.Tensor,
                    drafter: Drafter | None, in_core: torch.Tensor | None = None, fused=None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E(x_p) [N, d], h_{p-1} [N, d], cluster label [N]) over the continuation positions. With
    ``in_core`` (a vocabulary mask), next tokens in the core get the extra label ``M`` (= clusters).
    See :func:`example_rows`, which gives the token ``x_p`` in place of its embedding."""
    ids, prev, labels = example_rows(shard, embed, assignment, drafter, in_core, fused)
    return embed(ids).float() if len(ids) else prev.new_zeros(prev.shape), prev, labels


@torch.no_grad()
def example_rows(shard: dict[str, torch.Tensor], embed, assignment: torch.Tensor,
                 drafter: Drafter | None, in_core: torch.Tensor | None = None, fused=None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_p [N], h_{p-1} [N, d], cluster label [N]) over the continuation positions: the router's
    examples with the token in place of its embedding ``E(x_p)`` (8 bytes, not a row of d floats),
    which a lookup gives back when a batch needs it.

    A drafter that reads fused target layers (EAGLE-3) needs ``fused``: token ids [T] -> the fused
    features [T, k*d] of that sequence (the shards keep only the last layer). Its examples see what
    the router sees at draft time: ``fc`` of the fused feature at depth 0, its own output deeper."""
    tokens, feats = shard["tokens"].long(), shard["features"]
    teacher = shard.get("teacher")  # raw-text shards: the target's greedy next token everywhere
    offs = shard["offsets"].tolist()
    ids, prevs, labels = [], [], []
    core_label = int(assignment.max()) + 1  # the class after the last cluster
    for k, plen in enumerate(shard["prompt_lens"].tolist()):
        a, b = offs[k], offs[k + 1]
        seq, f = tokens[a:b], feats[a:b].float()
        # generated shards: the positions whose next token the target generated itself
        first = 2 if teacher is not None else max(plen - 1, 2)
        if b - a < first + 2:
            continue
        p = torch.arange(first, b - a - 1)
        nxt = teacher[a:b].long()[p] if teacher is not None else seq[p + 1]
        if "layer_inputs" in shard:  # computed once for a drafter with fused features
            f = torch.cat([shard["layer_inputs"][a:b], feats[a:b]], dim=-1).float()
        elif drafter is not None and drafter.feature_layers is not None:
            f = fused(seq).float()  # the drafter's own features; depth 0 reads them through fc
        variants = [f[p - 1] if drafter is None else drafter.project(f[p - 1]).float()]
        if drafter is not None:
            pos = torch.arange(1, b - a)[None]
            pred = drafter(embed(seq[1:]).float()[None], f[:-1][None], pos)[0]  # pred[j] ~ f[j + 1]
            variants.append(pred[p - 2].float())
        label = assignment[nxt].long()
        if in_core is not None:
            label = torch.where(in_core[nxt], core_label, label)
        for prev in variants:
            ids.append(seq[p])
            prevs.append(prev)
            labels.append(label)
    if not ids:
        d = feats.shape[1]
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, d), torch.zeros(0, dtype=torch.long)
    return torch.cat(ids), torch.cat(prevs), torch.cat(labels)


def recall_at(logits: torch.Tensor, labels: torch.Tensor, ks: list[int],
              core_index: int | None = None) -> dict[int, float]:
    """Fraction of labels among the top ``k`` classes; with a core class, the core is always on and
    does not take one of the ``k`` places."""
    if core_index is None:
        ranks = (logits > logits.gather(1, labels[:, None])).sum(1)
        return {k: float((ranks < k).float().mean()) for k in ks}
    clusters = logits[:, :core_index]
    in_core = labels == core_index
    lab = labels.clamp(max=core_index - 1)
    ranks = (clusters > clusters.gather(1, lab[:, None])).sum(1)
    return {k: float(((ranks < k) | in_core).float().mean()) for k in ks}


def train_router(shards: list[Path], embed, assignment: torch.Tensor, clusters: int, hidden_size: int,
                 *, drafter: Drafter | None, out: Path, fingerprint: dict[str, Any], width: int = 1024,
                 epochs: int = 3, lr: float = 2e-3, batch: int = 1024, holdout: int = 1, seed: int = 0,
                 core_ids: torch.Tensor | None = None, special_ids: tuple[int, ...] = (),
                 provenance: dict[str, Any] | None = None, fused=None,
                 layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train and save a router; returns held-out recall figures. ``core_ids``: the hybrid's always-on
    frequency core, for a core-aware router; ``special_ids`` (always on too) count as core.
    ``layers``: read the inputs of these target layers from beside the shards (computed when a
    drafter with fused features was trained on them) instead of recomputing them with ``fused``."""
    from tqdm import tqdm

    from dynaspec.training.shards import load_shard

    if len(shards) <= holdout:
        raise ValueError(f"need more than {holdout} shards (one is held out for recall)")
    torch.manual_seed(seed)
    core_index, in_core = None, None
    if core_ids is not None:
        # the layout takes the core out of its clusters; class `clusters` is "in the core"
        if int(assignment.max()) + 1 != clusters:
            raise ValueError("the cluster assignment does not use its last cluster id")
        core_index = clusters
        in_core = torch.zeros(len(assignment), dtype=torch.bool)
        in_core[core_ids.long()] = True
        in_core[list(special_ids)] = True
    rank, world = distributed.join()

    def rows(path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, h, y = example_rows(load_shard(path, layers), embed, assignment, drafter, in_core, fused)
        return x, h.to(torch.bfloat16), y

    # the train shards' examples: shard i built by process i % world, all at once, then sent to
    # the others, so every process holds them all (the batches take rows anywhere) but builds only
    # its share
    paths = shards[:-holdout]
    built = {i: rows(path) for i, path in enumerate(tqdm(paths, desc="examples", unit="shard", file=sys.stderr,
                                                         disable=rank != 0)) if i % world == rank}
    train_parts = [distributed.share(built.pop(i, None), i % world, world) for i in range(len(paths))]
    x = torch.cat([d[0] for d in train_parts])
    h = torch.cat([d[1] for d in train_parts])
    y = torch.cat([d[2] for d in train_parts])
    del train_parts
    router = Router(RouterConfig(hidden_size=hidden_size, width=width, clusters=clusters,
                                 core_class=core_index is not None))
    model = distributed.wrap(router, world)  # several processes: each takes rows rank::world of a batch
    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * max(1, len(y) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng = random.Random(seed)
    bar = tqdm(total=steps, desc="router", unit="step", file=sys.stderr, disable=rank != 0)
    for _ in range(epochs):
        order = list(range(len(y)))
        rng.shuffle(order)
        idx_all = torch.tensor(order)
        for s in range(0, len(y) - batch + 1, batch):
            idx = idx_all[s:s + batch]
            mine = idx[rank::world]
            # the embeddings as the examples held them before tokens replaced them: bfloat16
            logits = model(embed(x[mine]).to(torch.bfloat16).float(), h[mine].float())
            # this process's share of the batch mean, times world: DDP averages the gradients
            loss = F.cross_entropy(logits, y[mine], reduction="sum") / len(idx) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()) / world:.3f}")
    bar.close()
    router.eval()
    with torch.no_grad():
        held = [router_examples(load_shard(path, layers), embed, assignment, drafter, in_core, fused)
                for path in shards[-holdout:]]
        he = torch.cat([d[0] for d in held])
        hh = torch.cat([d[1] for d in held])
        hy = torch.cat([d[2] for d in held])
        ks = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, clusters + 1)))
        recall = recall_at(router(he, hh), hy, ks, core_index) if len(hy) else {}
    meta = {"target": fingerprint, "clusters_sha": cluster_digest(assignment),
            **({"core": {"size": int(core_ids.numel()), "sha": core_digest(core_ids)}}
               if core_ids is not None else {}),
            "training": {**(provenance or {}), "examples": int(len(y)), "epochs": epochs, "lr": lr,
                         "width": width, "held_out_examples": int(len(hy)),
                         "held_out_recall": {str(k): round(v, 4) for k, v in recall.items()}}}
    if rank == 0:
        router.save(out, meta)
    distributed.barrier(world)
    return meta["training"]


def train_shards(folders: list[str], max_shards: int | None) -> list[Path]:
    """Train-split shards of ``folders`` (first ``max_shards`` of each), ordered so that the last
    shard of the first folder comes last: the one held out for recall."""
    from dynaspec.errors import ConfigError
    from dynaspec.training.shards import describe_shards, shard_paths

    per_folder = []
    for folder in folders:
        found = shard_paths(folder)[:max_shards]
        if not found:
            raise ConfigError(f"no shards in {folder}: collect them with `dynaspec train-drafter --stage collect`")
        per_folder.append(found)
    first = per_folder[0]
    shards = [*first[:-1], *[p for rest in per_folder[1:] for p in rest], first[-1]]
    describe_shards(shards)  # refuses shards of another split than train
    return shards


def build_router(target_ref, work: list[str], clusters_ref: str, out: Path, *,
                 drafter_ref: str | None = None, width: int = 1024, epochs: int = 3, lr: float = 2e-3,
                 max_shards: int | None = None, core: int | None = None, frequency_ref: str | None = None,
                 batch: int = 1024, command: str = "") -> dict[str, Any]:
    """``dynaspec train-router``: load the target, its clusters (and drafter, and the hybrid's
    frequency core), train the router on the shards of ``work`` and write it to ``out``."""
    from dynaspec.errors import ConfigError
    from dynaspec.runtime.targets import load_drafter, load_target, resolve_artifact
    from dynaspec.shortlisters.clusters import load_clusters
    from dynaspec.training.shards import bound_heap_growth, layer_inputs_path

    bound_heap_growth()
    if (core is None) != (frequency_ref is None):
        raise ConfigError("--core and --frequency go together: the hybrid's always-on core is the top "
                          "--core tokens of the --frequency list")
    if core is not None and core < 1:
        raise ConfigError(f"--core {core} is invalid: must be at least 1")
    target = load_target(target_ref)
    fingerprint = target.fingerprint()
    drafter = load_drafter(drafter_ref, target).float() if drafter_ref else None
    fused, layers = None, ()
    shards = train_shards(work, max_shards)
    own = drafter.cfg.feature_layers if drafter is not None else None
    if own and all(layer_inputs_path(p, own[:-1]).exists() for p in shards):
        layers = own[:-1]  # dynaspec's fused drafter: its training left the lower layers' inputs there
    elif drafter is not None and drafter.feature_layers is not None:
        # EAGLE-3: the shards keep the target's last layer only; its fused layers are recomputed
        def fused(seq: torch.Tensor) -> torch.Tensor:
            return target.fused_features(seq, drafter.feature_layers)
    clusters = load_clusters(resolve_artifact(clusters_ref), fingerprint)
    core_ids = None
    if core is not None:
        from dynaspec.shortlisters.frequency import load_frequency

        core_ids = load_frequency(resolve_artifact(frequency_ref), fingerprint)[0][:core]
    return train_router(shards, target.embed, clusters["assignment"].long(), clusters["centroids"].shape[0],
                        target.hidden_size, drafter=drafter, out=out, fingerprint=fingerprint,
                        width=width, epochs=epochs, lr=lr, batch=batch, core_ids=core_ids,
                        special_ids=target.special_token_ids, fused=fused, layers=layers,
                        provenance={"command": command, "work": work, "clusters": clusters_ref,
                                    "drafter": drafter_ref, "frequency": frequency_ref, "core": core})
