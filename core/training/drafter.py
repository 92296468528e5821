"""``dynaspec train-drafter --stage train``: train the EAGLE-style drafter on collected shards.

The drafter predicts ``f_p`` from ``(E(x_p), f_{p-1})`` with a smooth-L1 regression in the space
the LM head reads plus a soft cross-entropy between the target's and the drafter's next-token
distributions. The 262k-way softmax is too dear on a CPU, so both distributions are taken over a
candidate set per batch: every token that occurs in the batch plus the most frequent tokens of the
collected text. With ``unroll=2`` the drafter is also trained on its own predicted features (the
second draft step sees ``(E(x_p), f^_{p-1})``), which is what deeper draft steps meet. Shards are
streamed one at a time (the collection is :mod:`dynaspec.training.collect`). Checkpoints
(safetensors + JSON, no pickles) are written every few hundred steps and at each epoch end; a rerun
resumes from the last one. The final drafter is written atomically.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import attrs
import torch
import torch.nn.functional as F

from dynaspec.errors import ConfigError
from dynaspec.runtime.drafter import Drafter, DrafterConfig
from dynaspec.runtime.files import atomic_write
from dynaspec.runtime.target import TargetModel
from dynaspec.training import distributed
from dynaspec.training.shards import (
    bound_heap_growth,
    describe_shard_set,
    describe_shards,
    layer_inputs_path,
    load_shard,
    positions,
    shard_paths,
)


def loss_mask(shard: dict[str, torch.Tensor], on: str = "answer") -> torch.Tensor:
    """Which features of ``shard`` the loss reads as targets. The drafter's prediction of feature
    ``j`` drafts token ``j + 1``: with ``on="answer"``, the features whose next token is the target's
    own continuation (what the drafter meets at inference: it drafts answers, never prompts); with
    ``on="all"``, every feature after the first of a sequence. The prompt positions stay in every
    window as context either way."""
    mask = torch.zeros(len(shard["tokens"]), dtype=torch.bool)
    offs = shard["offsets"].tolist()
    lens = shard["prompt_lens"].tolist() if on == "answer" and "prompt_lens" in shard else [2] * (len(offs) - 1)
    for a, b, plen in zip(offs[:-1], offs[1:], lens):
        mask[a + max(int(plen) - 1, 1):b] = True
    return mask


def _windows(shard: dict[str, torch.Tensor], window: int, mask: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """(start, end) ranges of at most ``window + 1`` tokens, inside one sequence each; with ``mask``
    (see :func:`loss_mask`) only those with a position the loss reads."""
    out = []
    offs = shard["offsets"].tolist()
    for a, b in zip(offs[:-1], offs[1:]):
        for s in range(a, b - 1, window):
            e = min(s + window + 1, b)
            if mask is None or bool(mask[s + 1:e].any()):
                out.append((s, e))
    return out


def _batches(shard, window: int, batch_positions: int, rng: random.Random,
             mask: torch.Tensor | None = None) -> Iterator[list[tuple[int, int]]]:
    wins = _windows(shard, window, mask)
    rng.shuffle(wins)
    batch, size = [], 0
    for w in wins:
        batch.append(w)
        size += w[1] - w[0] - 1
        if size >= batch_positions:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _frequent_tokens(paths: list[Path], count: int) -> torch.Tensor:
    counts = torch.zeros(0, dtype=torch.long)
    for path in paths:
        toks = load_shard(path)["tokens"].long()
        counts = torch.bincount(toks, minlength=max(counts.numel(), int(toks.max()) + 1)).add_(
            F.pad(counts, (0, max(0, int(toks.max()) + 1 - counts.numel()))))
    return counts.argsort(descending=True)[:count]


class _Unrolled(torch.nn.Module):
    """The drafter over ``unroll`` draft steps, each after the first fed the drafter's own predicted
    features: one forward per optimiser step, as DistributedDataParallel wants."""

    def __init__(self, drafter: Drafter, unroll: int) -> None:
        super().__init__()
        self.drafter, self.unroll = drafter, unroll

    def forward(self, emb: torch.Tensor, inp: torch.Tensor, first: torch.Tensor,
                positions: torch.Tensor) -> list[torch.Tensor]:
        preds = []
        first = self.drafter.project(first)  # fused target layers: what the first step reads of them
        for _ in range(self.unroll):
            pred = self.drafter(emb, inp, positions).float()
            preds.append(pred)
            inp = torch.cat([first, pred[:, :-1]], dim=1)  # the next step reads its own prediction
        return preds


def widen(drafter: Drafter, width: int, *, seed: int = 0) -> Drafter:
    """``drafter`` with its MLP widened to ``width``, computing the same function: its gate and up
    rows and down columns are kept, the new gate and up rows start at random (as an untrained layer
    would) and the new down columns at zero, so the new units add nothing until training moves
    them. More capacity for a drafter that has stopped improving, without starting over."""
    old = drafter.cfg.intermediate_size
    if width < old:
        raise ConfigError(f"width {width} is narrower than the drafter's {old}: a drafter can be widened, not narrowed")
    if width == old:
        return drafter
    with torch.random.fork_rng():  # the new rows' random start, without touching the caller's generator
        torch.manual_seed(seed)
        wide = Drafter(attrs.evolve(drafter.cfg, intermediate_size=width), meta=drafter.meta).to(
            drafter.fc.weight.dtype)
    state = drafter.state_dict()
    fresh = wide.state_dict()
    for name, value in state.items():
        target = fresh[name]
        if target.shape == value.shape:
            target.copy_(value)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            target[:old].copy_(value)  # new rows keep their random start
        elif name.endswith("down_proj.weight"):
            target.zero_()
            target[:, :old].copy_(value)
        else:
            raise AssertionError(f"{name}: {tuple(value.shape)} -> {tuple(target.shape)}")
    wide.load_state_dict(fresh)
    return wide


def embedding_rms(target: TargetModel, *, chunk: int = 16384) -> float:
    """The median over the vocabulary of a token embedding's RMS, as the drafter reads it
    (``target.embed``: with the target's own scale, if it has one)."""
    rms = []
    with torch.no_grad():
        for start in range(0, target.vocab_size, chunk):
            ids = torch.arange(start, min(start + chunk, target.vocab_size), device=target.device)
            rms.append(target.embed(ids).float().pow(2).mean(-1).sqrt().cpu())
    return float(torch.cat(rms).median())


def with_embed_norm(drafter: Drafter, scale: float) -> Drafter:
    """``drafter`` with an RMS norm on its token embedding (``DrafterConfig.embed_norm``) whose
    gains all start at ``scale``, the embeddings' typical RMS (:func:`embedding_rms`): a token
    embedding of that RMS goes into ``fc`` unchanged, so the drafter computes what it did (up to
    each token's distance from the typical RMS), and training can then grow the token's share of
    ``fc``'s input through the gains instead of through ``fc``'s own weights."""
    if drafter.cfg.embed_norm:
        return drafter
    normed = Drafter(attrs.evolve(drafter.cfg, embed_norm=True), meta=drafter.meta).to(drafter.fc.weight.dtype)
    state = dict(drafter.state_dict())
    state["embed_norm.weight"] = torch.full_like(normed.embed_norm.weight, scale)
    normed.load_state_dict(state)
    return normed


def _step_loss(model: torch.nn.Module, head: torch.Tensor, frequent: torch.Tensor, shard, batch,
               embed, noise: float, generator: torch.Generator, rank: int = 0,
               world: int = 1, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one optimiser step over ``batch`` (windows of one shard). Every process builds
    the whole batch (its candidate set, noise and position count), then runs rows ``rank::world``
    only; the loss is this process's share of the batch mean, times ``world`` since
    DistributedDataParallel averages the gradients, so any number of processes computes the
    gradient of one process over the whole batch. ``mask`` (see :func:`loss_mask`): the features
    the loss reads as targets; None, every one."""
    tokens, feats = shard["tokens"], shard["features"]
    # a drafter with fused features reads the inputs of lower layers beside the final one
    lower = shard.get("layer_inputs")
    d = feats.shape[1]
    extra = 0 if lower is None else lower.shape[1]
    width = max(b - a for a, b in batch) - 1
    bsz = len(batch)
    x = torch.zeros(bsz, width, dtype=torch.long)
    prev = torch.zeros(bsz, width, extra + d, dtype=torch.bfloat16)
    nxt = torch.zeros(bsz, width, d, dtype=torch.bfloat16)
    valid = torch.zeros(bsz, width, dtype=torch.bool)
    for row, (a, b) in enumerate(batch):
        n = b - a - 1
        x[row, :n] = tokens[a + 1:b].long()
        if lower is not None:
            prev[row, :n, :extra] = lower[a:b - 1]
        prev[row, :n, extra:] = feats[a:b - 1]
        nxt[row, :n] = feats[a + 1:b]
        valid[row, :n] = True if mask is None else mask[a + 1:b]
    cand = torch.unique(torch.cat([x[valid], frequent]))  # the tokens read where the loss is
    w_c = head.index_select(0, cand).float()  # [C, d]
    inp = prev.float()
    if noise:  # uniform noise at the scale of each layer's features
        scale = inp.unflatten(-1, (-1, d)).std(dim=(0, 1, 3)).repeat_interleave(d)
        inp = inp + (torch.rand(inp.shape, generator=generator) - 0.5) * noise * scale
    count = int(valid.sum())  # positions in the whole batch
    rows = slice(rank, None, world)
    x, inp, nxt, valid = x[rows], inp[rows], nxt[rows].float(), valid[rows]
    with torch.no_grad():
        emb = embed(x).float()
        teacher = torch.softmax((nxt[valid] @ w_c.T).float(), dim=-1)
    positions = torch.arange(1, width + 1)[None].expand(len(x), -1)
    preds = model(emb, inp, prev[rows][:, :1].float(), positions)
    total, stats = 0.0, {}
    for k, pred in enumerate(preds):
        reg = F.smooth_l1_loss(pred[valid], nxt[valid], reduction="sum") / (count * pred.shape[-1])
        logp = torch.log_softmax((pred[valid] @ w_c.T).float(), dim=-1)
        ce = -(teacher * logp).sum() / count
        total = total + (reg + ce) * (1.0 if k == 0 else 0.5)
        stats[f"ce{k}"] = float(ce.detach()) * world
        stats[f"acc{k}"] = float((logp.argmax(-1) == teacher.argmax(-1)).float().mean())
    return total * world, stats


def _layer_inputs(target: TargetModel, paths: list[Path], layers: tuple[int, ...]) -> None:
    """Compute, once, the inputs of target ``layers`` at every position of each shard (a drafter
    with fused features reads them), written atomically beside the shards; resumable."""
    from tqdm import tqdm

    if not layers:
        return
    todo = [p for p in paths if not layer_inputs_path(p, layers).exists()]
    for path in tqdm(todo, desc=f"layers {','.join(map(str, layers))}", unit="shard", file=sys.stderr,
                     disable=not todo):
        shard = load_shard(path)
        tokens, offs = shard["tokens"].long().to(target.device), shard["offsets"].tolist()
        parts = [target.fused_features(tokens[a:b], layers) for a, b in zip(offs[:-1], offs[1:])]
        write_layer_inputs(target, path, layers, parts)


def lower_layers(target: TargetModel, feature_layers: Sequence[int] | None) -> tuple[int, ...]:
    """The target layers below the final state whose inputs a fused drafter reads, sorted;
    refuses layers the target does not have."""
    lower = tuple(sorted({int(i) for i in feature_layers or ()}))
    count = len(target.decoder.layers)
    if any(not 0 <= i < count for i in lower):
        raise ConfigError(f"feature layers {list(lower)} must lie in 0..{count - 1}: the target has {count} layers")
    return lower


def write_layer_inputs(target: TargetModel, shard: Path, layers: tuple[int, ...], parts: list[torch.Tensor]) -> None:
    """Write the inputs of target ``layers`` for ``shard`` (one [T, len(layers) * d] tensor per
    sequence), atomically, where :func:`~dynaspec.training.shards.load_shard` finds them."""
    from safetensors.torch import save_file

    inputs = torch.cat(parts).to(torch.bfloat16).cpu().contiguous()
    out = layer_inputs_path(shard, layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda p, inputs=inputs: save_file({"inputs": inputs}, str(p), metadata={
        "layers": ",".join(map(str, layers)), "target": target.fingerprint()["lm_head_sha256_rows64"]}))


def _save_checkpoint(drafter: Drafter, opt: torch.optim.Optimizer, state: dict[str, Any], work: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    names = {id(p): n for n, p in drafter.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"opt.{names[id(p)]}.{key}"] = value.contiguous()
    atomic_write(work / "checkpoint.safetensors", lambda p: save_file(tensors, str(p)))
    atomic_write(work / "checkpoint.json", lambda p: Path(p).write_text(json.dumps(state, indent=2)))


def _load_checkpoint(drafter: Drafter, opt: torch.optim.Optimizer, work: Path) -> dict[str, Any] | None:
    from safetensors.torch import load_file

    if not (work / "checkpoint.json").exists() or not (work / "checkpoint.safetensors").exists():
        return None
    state = json.loads((work / "checkpoint.json").read_text())
    tensors = load_file(str(work / "checkpoint.safetensors"))
    drafter.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    params = dict(drafter.named_parameters())
    for name, p in params.items():
        exp_avg = tensors.get(f"opt.{name}.exp_avg")
        if exp_avg is not None:
            opt.state[p] = {"step": torch.tensor(float(state["step"])), "exp_avg": exp_avg,
                            "exp_avg_sq": tensors[f"opt.{name}.exp_avg_sq"]}
    return state


def training_precision(name: str, device: torch.device | str = "cpu") -> str:
    """A ``precision`` setting of :func:`train` as the one used: ``auto`` is ``bfloat16`` where
    ``device`` computes it natively (:func:`dynaspec.runtime.numerics.native_bf16`), else ``float32``."""
    from dynaspec.runtime.numerics import native_bf16

    if name not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"precision {name!r}: one of auto, bfloat16, float32")
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    return name


def train(target: TargetModel, work: Path | Sequence[Path], out: Path, *, epochs: int = 2, steps: int | None = None,
          lr: float = 1e-3, window: int = 256, batch_positions: int = 2048, unroll: int = 2,
          frequent: int = 2048, noise: float = 0.1, max_shards: int | None = None, seed: int = 0,
          checkpoint_every: int = 100, provenance: dict[str, Any] | None = None,
          intermediate_size: int | None = None, feature_layers: Sequence[int] | None = None,
          init: Drafter | None = None, loss_on: str = "answer", precision: str = "auto",
          embed_norm: bool = False) -> Drafter:
    """Train a drafter on the collected shards of ``work`` (one folder, or several: say an English
    and code collection and a non-English one); write it to ``out``.

    With ``steps`` the run lasts that many optimiser steps and the shard list is read again at
    every epoch, so a collection still running beside the training feeds later epochs. Checkpoints
    live in ``<first work folder>/ckpt-<out name>``; a rerun with the same arguments resumes there.
    ``intermediate_size`` sets the width of the drafter's MLP (default: the target's).
    ``feature_layers`` (EAGLE-3-style fused features): target layers whose inputs the drafter reads
    beside the final hidden state, computed once per shard into ``layers-A-B/`` beside it.
    ``init``: start from this drafter's weights instead of random ones (more training on more
    data); its architecture is kept, except that a wider ``intermediate_size`` widens its MLP
    (:func:`widen`: the same function at the start); a narrower width or other feature layers are
    refused.
    ``embed_norm``: an RMS norm on the token embedding before ``fc`` (``DrafterConfig.embed_norm``);
    an ``init`` drafter without one gets it at gains that keep its function (:func:`with_embed_norm`),
    one with it keeps it (left out, ``init``'s architecture is kept as it is).
    ``loss_on``: ``"answer"`` trains on the positions whose next token is the target's own
    continuation (the prompts are context only), ``"all"`` on the prompts' positions too.
    ``precision``: the products of each step in ``bfloat16`` (autocast; the weights, the optimiser
    and the losses stay float32) or ``float32``; ``auto`` is bfloat16 where the device computes it
    natively (a whole step 1.6 times as fast as in float32 on one Zen 4 core: 3.97 against 6.44 s).
    """
    from tqdm import tqdm

    folders = [Path(work)] if isinstance(work, (str, Path)) else [Path(w) for w in work]
    first = folders[0]

    def shard_list() -> list[Path]:
        return [p for folder in folders for p in shard_paths(folder)[:max_shards]]

    if loss_on not in ("answer", "all"):
        raise ConfigError(f"loss_on = {loss_on!r}: one of 'answer', 'all'")
    mixed = training_precision(precision, target.device) == "bfloat16"
    paths = shard_list()
    if not paths:
        raise FileNotFoundError(f"no shards in {', '.join(map(str, folders))}: run the collection first")
    describe_shards(paths)  # refuses dev shards before any training
    ckpt = first / f"ckpt-{out.name}"
    ckpt.mkdir(parents=True, exist_ok=True)
    rank, world = distributed.join()
    torch.manual_seed(seed)
    lower = lower_layers(target, feature_layers)
    count = len(target.decoder.layers)
    if init is not None:
        config = init.cfg
        kept = tuple(config.feature_layers[:-1]) if config.feature_layers else ()
        if feature_layers is not None and lower != kept:
            raise ConfigError(f"feature layers {list(lower)} differ from the starting drafter's {list(kept)}: "
                              "leave them out to keep its own")
        if intermediate_size is not None and intermediate_size < config.intermediate_size:
            raise ConfigError(f"width {intermediate_size} is narrower than the starting drafter's "
                              f"{config.intermediate_size}: a drafter can be widened, not narrowed; leave "
                              "it out to keep its own")
        lower = kept
    else:
        config = DrafterConfig.like_target(target.model, intermediate_size=intermediate_size)
        if lower:
            config = attrs.evolve(config, feature_layers=(*lower, count))  # the final state last
        if embed_norm:
            config = attrs.evolve(config, embed_norm=True)
    _layer_inputs(target, paths, lower)
    drafter = Drafter(config).float()
    if init is not None:
        drafter.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
        if intermediate_size is not None and intermediate_size > config.intermediate_size:
            drafter = widen(drafter, intermediate_size, seed=seed)
        if embed_norm and not config.embed_norm:
            drafter = with_embed_norm(drafter, embedding_rms(target))
    bound_heap_growth()
    head = target.lm_head_weight.detach()
    freq = _frequent_tokens(paths, frequent)
    total_steps = steps or epochs * max(1, positions(paths) // batch_positions)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    state = _load_checkpoint(drafter, opt, ckpt) or {"step": 0, "epoch": 0, "shard": 0, "shards": []}

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / 50)
        return lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))

    embed = target.embed
    model = distributed.wrap(_Unrolled(drafter, unroll), world)  # each process: the whole model
    bar = tqdm(total=total_steps, initial=min(state["step"], total_steps), desc="train", unit="step",
               file=sys.stderr, disable=rank != 0)
    start = time.time()
    earlier_seconds = state.get("seconds", 0.0)  # training time of the runs this one resumes

    def checkpoint(at: dict[str, Any]) -> None:
        if rank == 0:  # the processes hold the same weights: one writes them
            _save_checkpoint(drafter, opt, {**at, "seconds": round(earlier_seconds + time.time() - start, 3)},
                             ckpt)

    drafter.train()
    seen_positions = 0
    def done() -> bool:
        return state["step"] >= total_steps if steps is not None else state["epoch"] >= epochs

    while not done():
        if not state["shards"]:  # a new epoch: the current shard list, shuffled
            current = shard_list()
            describe_shards(current)  # a shard added since the start must be train too
            _layer_inputs(target, current, lower)
            names = [os.path.relpath(p, first) for p in current]  # plain names for the first folder
            random.Random(seed + state["epoch"]).shuffle(names)
            state["shards"] = names
        for pos in range(state["shard"], len(state["shards"])):
            shard = load_shard(first / state["shards"][pos], lower)
            rng = random.Random(seed * 1000 + state["epoch"] * 100 + pos)
            mask = loss_mask(shard, loss_on)
            for batch in _batches(shard, window, batch_positions, rng, mask):
                if steps is not None and done():
                    break
                for group in opt.param_groups:
                    group["lr"] = lr_at(state["step"])
                noise_gen = torch.Generator().manual_seed(seed * 1_000_003 + state["step"])
                with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=mixed):
                    loss, stats = _step_loss(model, head, freq, shard, batch, embed, noise, noise_gen, rank, world,
                                             mask)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
                opt.step()
                state["step"] += 1
                seen_positions += sum(int(mask[a + 1:b].sum()) for a, b in batch)
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()}, shards=len(state["shards"]))
                if state["step"] % checkpoint_every == 0:
                    checkpoint({**state, "shard": pos})
            if steps is not None and done():
                break
            state["shard"] = pos + 1
        else:
            state["epoch"] += 1
            state["shard"], state["shards"] = 0, []
        checkpoint(state)
    bar.close()
    drafter.eval()
    used = shard_list()
    described = describe_shards(used)
    shard_sets = [describe_shard_set([p for p in used if p.parent == folder]) for folder in folders]
    drafter.meta = {
        "target": target.fingerprint(),
        "training": {**(provenance or {}), "data": described["data"], "shard_sources": described["sources"],
                     "steps": state["step"], "epochs_started": state["epoch"] + 1,
                     "feature_layers": list(config.feature_layers or ()) or None,
                     "lr": lr, "window": window, "batch_positions": batch_positions, "unroll": unroll,
                     "frequent": frequent, "noise": noise, "loss_on": loss_on,
                     "precision": "bfloat16" if mixed else "float32", "shards_at_end": len(used),
                     "positions_at_end": sum(one["positions"] for one in shard_sets), "shard_sets": shard_sets,
                     "train_seconds_this_run": round(time.time() - start, 1),
                     "train_seconds": round(earlier_seconds + time.time() - start, 1),
                     "positions_seen_this_run": seen_positions,
                     "processes": world},  # under torchrun each took a share of every batch
    }
    if rank == 0:
        drafter.save(out)
    distributed.barrier(world)
    return drafter
