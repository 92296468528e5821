"""The DynaSpec router and the ``dynaspec`` shortlister.

The router ``r([E(x_t), H~_{t-1}]) -> R^M`` scores the vocabulary clusters from the two inputs the
drafter consumes at a draft step (so it can run beside the draft decoder layer). The shortlist at
depth ``t`` is the union of the top ``k_c(t)`` clusters (``k_c`` from the scheduler), plus the
special tokens, which always form a span of their own at the front of the head layout.

With ``context = N`` the shortlist also holds the distinct tokens of the last ``N`` committed tokens
that the chosen clusters miss (names, code identifiers and words of the prompt's language recur in a
conversation): a small tail of scattered ids after the cluster spans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from dynaspec.errors import ConfigError
from dynaspec.runtime.artifacts import read_artifact, write_artifact
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import is_text, non_negative_int, param
from dynaspec.runtime.quantized import drafter_on_kernel
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, DraftStep, Shortlist

from .clusters import load_clusters
from .frequency import context_param, load_frequency

FORMAT = "dynaspec-router/1"
FILE = "router.safetensors"


@attrs.frozen
class RouterConfig:
    hidden_size: int  # d of the target (each of the two inputs)
    width: int
    clusters: int
    #: one more output scoring "the next token is in the hybrid's always-on core" (index ``clusters``)
    core_class: bool = False


RMS_EPS = 1e-6


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + RMS_EPS).to(x.dtype)


class Router(nn.Module):
    """Two-layer MLP over ``[rms(E(x_t)), rms(H~_{t-1})]`` -> cluster logits."""

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(2 * cfg.hidden_size, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.clusters + int(cfg.core_class))
        #: a compiled RMS norm without weight (``x, eps -> normed x``), set on a router copied
        #: onto the target's quantised kernel (``quantized.drafter_on_kernel``): both inputs normed
        #: in one C call instead of some fourteen tensor operations; None: torch's
        self.c_norm = None

    def forward(self, token_embeddings: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        dtype = self.inp.weight.dtype
        if self.c_norm is not None and token_embeddings.dtype == prev_hidden.dtype == dtype:
            both = torch.stack([token_embeddings, prev_hidden], dim=-2)  # [..., 2, d]: one row each
            x = self.c_norm(both, RMS_EPS).flatten(-2)
        else:
            x = torch.cat([_rms(token_embeddings), _rms(prev_hidden)], dim=-1).to(dtype)
        return self.out(F.silu(self.inp(x)))

    def save(self, path: str | Path, meta: dict[str, Any]) -> Path:
        tensors = {k: v.detach().to(torch.bfloat16) for k, v in self.state_dict().items()}
        return write_artifact(path, FILE, FORMAT, tensors, meta,
                              extra={"config": json.dumps(attrs.asdict(self.cfg))})

    @classmethod
    def load(cls, path: str | Path, fingerprint: dict[str, Any] | None) -> tuple["Router", dict[str, Any]]:
        tensors, meta, metadata = read_artifact(path, FILE, FORMAT, what="router", fingerprint=fingerprint)
        router = cls(RouterConfig(**json.loads(metadata["config"])))
        # assign: the stored tensors become the parameters (wherever the default device points)
        router.load_state_dict({k: v.float() for k, v in tensors.items()}, assign=True)
        return router.eval(), meta


class ClusterLayout:
    """Clusters laid out contiguously: special tokens first (always on), then cluster by cluster."""

    def __init__(self, assignment: torch.Tensor, clusters: int, special: tuple[int, ...], *,
                 device: torch.device | str = "cpu") -> None:
        assignment = assignment.long().to(device, copy=True)
        special_t = torch.tensor(sorted(set(special)), dtype=torch.long, device=device)
        keep = torch.ones_like(assignment, dtype=torch.bool)
        keep[special_t] = False
        ids = torch.arange(assignment.numel(), device=device)[keep]
        order = ids[torch.argsort(assignment[keep], stable=True)]
        sizes = torch.bincount(assignment[keep], minlength=clusters)
        self.n_special = special_t.numel()
        self.order = torch.cat([special_t, order])  # the head layout (a permutation of the vocabulary)
        offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]) + self.n_special
        self.offsets = offsets.tolist()  # read per selected cluster at every step: plain ints
        self.sizes = sizes
        self.members = [self.order[self.offsets[m]:self.offsets[m + 1]] for m in range(clusters)]
        self.special = special_t
        #: cluster of every token; the always-on tokens get the extra index ``clusters``
        self.cluster_of = assignment
        self.cluster_of[special_t] = clusters
        self.clusters = clusters

    def missing(self, tokens: torch.Tensor, selected: list[int]) -> torch.Tensor:
        """The distinct ``tokens`` outside the always-on tokens and the ``selected`` clusters."""
        tokens = torch.unique(tokens.long())
        on = torch.zeros(self.clusters + 1, dtype=torch.bool, device=tokens.device)
        on[self.clusters] = True
        if selected:
            on[torch.tensor(selected, dtype=torch.long, device=tokens.device)] = True
        return tokens[~on[self.cluster_of[tokens]]]

    def shortlist(self, selected: list[int], context: torch.Tensor | None = None) -> Shortlist:
        """Union of the selected clusters and the special tokens, with merged layout spans, plus the
        ``context`` tokens they miss as a gathered tail."""
        selected = sorted(set(selected))
        spans: list[list[int]] = [[0, self.n_special]] if self.n_special else []
        for m in selected:
            a, b = self.offsets[m], self.offsets[m + 1]
            if a == b:
                continue
            if spans and spans[-1][1] == a:
                spans[-1][1] = b
            else:
                spans.append([a, b])
        parts = [self.special, *[self.members[m] for m in selected]]
        if context is not None and context.numel():
            parts.append(self.missing(context, selected))
        ids = torch.cat(parts) if len(parts) > 1 else self.special
        return Shortlist(ids, spans=tuple((a, b) for a, b in spans))


class DynaSpecShortlister:
    """Routes each draft step to the top ``k_c(t)`` vocabulary clusters."""

    def __init__(self, router: Router, layout: ClusterLayout, *, per_row: bool = False,
                 context: int = 0) -> None:
        self.router = router
        self.layout = layout
        self.head_layout = layout.order
        self.per_row = per_row
        #: how many of the last committed tokens join the shortlist (0: none)
        self.context = context
        #: index of the router's "always-on core" output (a core-aware router), else None
        self.core_index = router.cfg.clusters if router.cfg.core_class else None
        #: the scheduler's budget counts clusters here (the engine checks it fits)
        self.budget_unit = "clusters"
        self.budget_limit = router.cfg.clusters + int(router.cfg.core_class)

    @torch.inference_mode()
    def propose(self, step: DraftStep, scheduler):
        # With a core-aware router the core is one more scored slot: the scheduler's budget and
        # probability mass count it like a cluster, and it costs nothing since it is always on.
        scores = torch.softmax(self.router(step.token_embeddings, step.prev_hidden).float(), dim=-1)
        k = max(1, min(int(scheduler.budget(depth=step.depth, scores=scores)), scores.shape[-1]))
        top = scores.topk(k, dim=-1).indices
        rows = [[m for m in row.tolist() if m != self.core_index] for row in top]
        recent = step.context[-self.context:] if self.context and step.context is not None else None
        if self.per_row:
            return [self.layout.shortlist(row, recent) for row in rows]
        return self.layout.shortlist([m for row in rows for m in row], recent)


def _artifact(what: str) -> Any:
    return param(help=what, check=is_text, rule="must be a non-empty string (an artifact name or a path)")


@attrs.frozen
class DynaSpecParams:
    clusters: str = _artifact("the vocabulary's clusters (see `dynaspec build-clusters`)")
    router: str = _artifact("the router over those clusters (see `dynaspec train-router`)")
    per_row: bool = param(False, help="one shortlist per draft row instead of their union",
                          check=lambda v: isinstance(v, bool), rule="must be true or false")
    context: int = context_param()


@attrs.frozen
class HybridParams:
    clusters: str = _artifact("the vocabulary's clusters (see `dynaspec build-clusters`)")
    router: str = _artifact("a router trained with --core/--frequency for this core")
    frequency: str = _artifact("the frequency list whose top `core` tokens are always on")
    core: int = param(2048, help="always-on frequent tokens", unit="tokens", check=non_negative_int,
                      rule="must be an integer >= 0")
    per_row: bool = param(False, help="one shortlist per draft row instead of their union",
                          check=lambda v: isinstance(v, bool), rule="must be true or false")
    context: int = context_param()


def _dynaspec(params: DynaSpecParams | HybridParams, ctx: BuildContext,
              core_sha: str | None = None) -> DynaSpecShortlister:
    clusters_path, router_path = params.clusters, params.router
    fingerprint = dict(ctx.target_fingerprint)
    data = load_clusters(ctx.resolve_artifact(str(clusters_path)), fingerprint)
    router, meta = Router.load(ctx.resolve_artifact(str(router_path)), fingerprint)
    # the router runs in the target's dtype and place: in bfloat16 it reads half the bytes per step,
    # and on the target's int8 kernel (as the drafter does) a quarter of float32's
    router.to(device=ctx.device, dtype=ctx.lm_head_weight.dtype)
    router = drafter_on_kernel(router, ctx.weights)
    m = data["centroids"].shape[0]
    if router.cfg.clusters != m:
        raise ConfigError(f"router scores {router.cfg.clusters} clusters but the cluster file has {m}")
    if meta.get("clusters_sha") and meta["clusters_sha"] != cluster_digest(data["assignment"]):
        raise ConfigError("the router was trained for another clustering of the vocabulary")
    core = meta.get("core")
    if router.cfg.core_class and (core_sha is None or core is None or core.get("sha") != core_sha):
        trained = f"a {core['size']}-token frequency core" if core else "a frequency core"
        raise ConfigError(f"the router at {router_path!r} was trained for the hybrid shortlister with "
                          f"{trained}; use it with shortlister 'hybrid' and that same 'frequency' list "
                          "and 'core' size")
    layout = ClusterLayout(data["assignment"], m, ctx.special_token_ids, device=ctx.device)
    return DynaSpecShortlister(router, layout, per_row=params.per_row, context=params.context)


def _hybrid(params: HybridParams, ctx: BuildContext) -> DynaSpecShortlister:
    """The routed clusters united with an always-on core of the most frequent tokens."""
    core = params.core
    ranked, _ = load_frequency(ctx.resolve_artifact(params.frequency), dict(ctx.target_fingerprint))
    always = tuple(sorted(set(ctx.special_token_ids) | set(ranked[:core].tolist())))
    inner = BuildContext(**{**attrs.asdict(ctx, recurse=False), "special_token_ids": always})
    return _dynaspec(params, inner, core_sha=core_digest(ranked[:core]))


def _int32_digest(values: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(values.to(torch.int32).contiguous().numpy().tobytes()).hexdigest()[:16]


def core_digest(core_ids: torch.Tensor) -> str:
    """Identity of an always-on frequency core (its token set), recorded by a core-aware router."""
    return _int32_digest(torch.sort(core_ids.to(torch.int64)).values)


def cluster_digest(assignment: torch.Tensor) -> str:
    return _int32_digest(assignment)


@hookimpl
def dynaspec_shortlisters():
    return [Component("dynaspec", _dynaspec, "context-routed union of vocabulary clusters (DynaSpec)",
                      params=DynaSpecParams),
            Component("hybrid", _hybrid, "routed clusters plus an always-on core of frequent tokens",
                      params=HybridParams)]
