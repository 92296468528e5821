"""In-test components, registered by name like any plugin."""

from __future__ import annotations

import torch

from dynaspec import Component, hookimpl
from dynaspec.runtime.types import Shortlist


class RandomSubset:
    """A fresh random subset of the vocabulary at every step (budget = subset size)."""

    def __init__(self, params, ctx):
        self.vocab = ctx.vocab_size
        self.special = torch.tensor(ctx.special_token_ids, dtype=torch.long)
        self.gen = torch.Generator().manual_seed(int(params.get("seed", 0)))
        self.per_row = bool(params.get("per_row", False))

    def _one(self, budget):
        ids = torch.randperm(self.vocab, generator=self.gen)[:budget]
        return Shortlist(torch.unique(torch.cat([ids, self.special])))

    def propose(self, step, scheduler):
        budget = scheduler.budget(depth=step.depth)
        if self.per_row:
            return [self._one(budget) for _ in range(step.tokens.numel())]
        return self._one(budget)


class ExcludeIds:
    """Everything except some ids: drafts can never propose them."""

    def __init__(self, params, ctx):
        keep = torch.ones(ctx.vocab_size, dtype=torch.bool)
        keep[list(params["exclude"])] = False
        self.shortlist = Shortlist(keep.nonzero().flatten())

    def propose(self, step, scheduler):
        return self.shortlist


class Halving:
    """Budget halves with depth (a position-aware-like schedule)."""

    def __init__(self, params, ctx):
        self.start = int(params.get("start", 64))

    def budget(self, *, depth, scores=None):
        return max(1, self.start >> depth)


class TestPlugin:
    @hookimpl
    def dynaspec_shortlisters(self):
        return [Component("random-subset", RandomSubset, "random rows, for tests"),
                Component("exclude", ExcludeIds, "all but some ids, for tests")]

    @hookimpl
    def dynaspec_schedulers(self):
        return [Component("halving", Halving, "budget halves with depth")]
