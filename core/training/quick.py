"""Drafter training on in-memory token sequences (small targets: tests, demos, prototypes).

For each sequence the target gives its normed features ``f_p``; the drafter reads
``(E(x_p), f_{p-1})`` and is trained to predict ``f_p``: a smooth-L1 regression in the space the LM
head reads, plus a soft cross-entropy between the target's next-token distribution and the one the
LM head gives on the drafter's prediction.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.target import TargetModel


@torch.no_grad()
def target_features(target: TargetModel, ids: Sequence[int]) -> torch.Tensor:
    """Normed final hidden states of the target over a whole sequence, [T, d]."""
    ids_t = torch.tensor(list(ids))
    return target.forward(ids_t, torch.arange(len(ids_t)), target.new_cache()).float()


def greedy_sequences(target: TargetModel, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Prompts continued by the target's own greedy decoding (text the target itself writes)."""
    out = []
    for prompt in prompts:
        gen = target.model.generate(torch.tensor([list(prompt)]), max_new_tokens=new_tokens,
                                    do_sample=False)
        out.append(gen[0].tolist())
    return out


def train_drafter(drafter: Drafter, target: TargetModel, sequences: Sequence[Sequence[int]], *,
                  steps: int = 200, lr: float = 3e-3, ce_weight: float = 1.0, seed: int = 0) -> list[float]:
    """Train ``drafter`` in place on whole sequences; returns the loss curve."""
    torch.manual_seed(seed)
    data = []
    for seq in sequences:
        feats = target_features(target, seq)
        with torch.no_grad():
            emb = target.embed(torch.tensor(list(seq))).float()
            teacher = torch.softmax(target.logits(feats), dim=-1)
        # drafter position p (1..T-1) reads (E(x_p), f_{p-1}) and predicts f_p
        data.append(tuple(x.clone() for x in (emb[1:], feats[:-1], feats[1:], teacher[1:])))
    head = target.lm_head_weight.detach().float()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    drafter.train()
    losses = []
    for step in range(steps):
        emb, prev, nxt, teacher = data[step % len(data)]
        pos = torch.arange(1, emb.shape[0] + 1)[None]
        pred = drafter(emb[None], prev[None], pos)[0]
        loss = F.smooth_l1_loss(pred, nxt)
        logp = torch.log_softmax(pred @ head.T, dim=-1)
        loss = loss + ce_weight * -(teacher * logp).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    drafter.eval()
    return losses
