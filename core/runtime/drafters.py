"""Drafters as components: what proposes the tokens the target verifies.

A stack names its drafter like any other component (``drafter = "ngram"``, or a ``[drafter]``
table with ``name`` and parameters). A drafter component's factory is called as
``factory(params, ctx: DrafterContext)`` and returns a :class:`DraftSource`. The built-ins
(:mod:`dynaspec.plugins.drafters`):

* ``trained``: a drafter trained by ``dynaspec prepare`` (or a published EAGLE-1/2/3 checkpoint),
  drafting through the stack's shortlister, scheduler and GEMM backend;
* ``eagle``: a published EAGLE-1/2/3 checkpoint only;
* ``ngram``: prompt lookup, the continuation of the latest earlier occurrence of the text's last
  n tokens in the prompt and the output so far, with no model at all;
* ``composite``: several drafters; in a chain stack the first that proposes anything drafts the
  cycle, in a tree stack (greedy) their proposals are merged into one tree.

A plain string that names no drafter component is a trained drafter's artifact:
``drafter = "gemma3-270m"`` means ``{name = "trained", artifact = "gemma3-270m"}``.

A :class:`DraftSource` says what the engine must keep for it (the target features it reads), how
large its trees can get (for the buffers) and whether every tree it grows is a chain (for the
exactness verdict), and starts one :class:`DraftSession` per generation. A session's ``grow`` is
called once per cycle with the committed tokens and returns the draft tree below the last one.
Everything a drafter proposes is verified by the target, so no drafter can change the output.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol, Sequence

import attrs
import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import ComponentRef, DraftConfig
from dynaspec.runtime.tree import DraftTree


class DraftSession(Protocol):
    """One generation's drafting state (a drafter's KV cache, an n-gram index, ...)."""

    def grow(self, tokens: torch.Tensor, features: torch.Tensor, n: int, params, verifier, generator,
             stats, depth: int | None = None) -> DraftTree:
        """The draft tree below the last committed token, at most ``depth`` positions deep
        (``None``: the drafter's own depth; a server batching several requests lowers it). A session
        whose ``grow`` takes no ``depth`` still works: the engine cuts its trees.

        ``tokens[:n]`` are the committed tokens (prompt and output); ``features[:n - 1]`` the
        target's features at those positions (see :attr:`DraftSource.feature_layers`). The tree's
        root is ``tokens[n - 1]``; a tree with the root alone means "no draft this cycle" (the
        target then takes one plain step). For lossless sampling, every drafted node's parent
        needs ``tree.draft_probs[parent] = (token_ids, probs)``: the distribution its children were
        drawn from without replacement (a one-point distribution for a deterministic proposal).
        """


class DraftSource(Protocol):
    """What a drafter component builds, once per engine."""

    #: the target layers whose fused inputs it reads as features (None: the target's final
    #: hidden state); only read when ``needs_features``
    feature_layers: tuple[int, ...] | None
    #: whether it reads the target's features at all (an n-gram drafter does not)
    needs_features: bool
    #: the drafter's neural model, if it has one (for tools that inspect it), else None
    model: torch.nn.Module | None
    #: the most tokens one tree can hold beyond its root, and its greatest depth
    max_tokens: int
    max_depth: int
    #: every tree it grows is a chain (a chain is verified exactly as plain decoding computes it)
    chains_only: bool

    def start(self, capacity: int) -> DraftSession:
        """A session for one generation of at most ``capacity`` positions."""


@attrs.frozen(eq=False)
class DrafterContext:
    """What a drafter component's factory gets besides its parameters."""

    #: the target model (:class:`dynaspec.runtime.target.TargetModel`)
    target: Any
    #: the stack's draft shape: mode (chain or tree), depth, topk, total tokens, confidence stop
    draft: DraftConfig
    #: the stack's shortlister and budget scheduler (for drafters with an output head)
    shortlister: Any
    scheduler: Any
    #: the stack's GEMM backend for a head: ``backend_for(None)`` multiplies the target's LM head,
    #: ``backend_for(weight)`` a drafter's own head
    backend_for: Callable[[torch.Tensor | None], Any]
    #: build another drafter of the stack (what a composite is made of)
    build: Callable[[Any], DraftSource]
    #: a neural drafter model the caller already loaded (used by ``trained`` instead of loading)
    model: torch.nn.Module | None = None
    #: loaded models shared by the engines of one process, by artifact (see ``Engine.from_stacks``)
    models: dict = attrs.field(factory=dict)


def drafter_component(ref: ComponentRef, registry) -> ComponentRef:
    """``ref`` with the shorthand resolved: a name no drafter component has is a trained drafter's
    artifact (built-in name, folder or Hub id)."""
    if ref.name in registry.names("drafter"):
        return ref
    if ref.params:
        from dynaspec.errors import UnknownComponentError

        raise UnknownComponentError(
            f"unknown drafter '{ref.name}' (with parameters {', '.join(ref.kwargs)}): a drafter table names a "
            f"drafter component ({', '.join(registry.names('drafter'))}); a trained drafter's artifact "
            "goes in its 'artifact' parameter")
    return ComponentRef("trained", {"artifact": ref.name})


def build_drafter(ref: Any, ctx: DrafterContext, registry) -> DraftSource:
    """Build the drafter ``ref`` (a name, a table or a :class:`ComponentRef`) in ``ctx``."""
    from dynaspec.runtime.config import _component

    ref = drafter_component(_component(ref), registry)
    source = registry.build("drafter", ref.name, ref.kwargs, ctx)
    for attr in ("feature_layers", "needs_features", "max_tokens", "max_depth", "chains_only", "start"):
        if not hasattr(source, attr):
            raise ConfigError(f"drafter '{ref.name}' built an object without '{attr}': a drafter component "
                              "must return a DraftSource (see dynaspec.runtime.drafters)")
    return source


# -- the trained drafter ----------------------------------------------------------------------------
class NeuralSource:
    """An EAGLE-style drafter model drafting through the stack's shortlister, scheduler and backend."""

    needs_features = True

    def __init__(self, model, ctx: DrafterContext, *, context: int | None = None) -> None:
        """``context``: at its first draft of a generation the drafter reads only the last
        ``context`` positions of the text (None: all of it), and every position after them."""
        from dynaspec.runtime.drafting import Drafting
        from dynaspec.runtime.quantized import drafter_on_kernel

        # the drafter's dense products on the target's quantised kernel, where it has one
        model = drafter_on_kernel(model, getattr(ctx.target, "weights", None), ctx.models)
        self.model = model
        self.feature_layers = model.feature_layers
        self.drafting = Drafting(ctx.draft, ctx.target, model, ctx.shortlister, ctx.scheduler,
                                 ctx.backend_for(model.head_weight))
        cfg = ctx.draft
        self.max_depth, self.max_tokens = cfg.depth, max(cfg.total_tokens, cfg.depth)
        self.chains_only = cfg.mode == "chain" or cfg.topk == 1
        self.context = context

    def start(self, capacity: int) -> "_NeuralSession":
        return _NeuralSession(self.drafting, capacity, self.context)


class _NeuralSession:
    def __init__(self, drafting, capacity: int, context: int | None = None) -> None:
        from dynaspec.runtime.drafter import DraftCache

        self.drafting, self.cache, self.context = drafting, DraftCache(capacity), context
        #: the first position the drafter reads (set at its first draft: the text's last
        #: ``context`` positions then, or all of it)
        self.offset: int | None = None

    def grow(self, tokens, features, n, params, verifier, generator, stats, depth=None,
             chain=False) -> DraftTree:
        # the drafter consumes (x_p, f_{p-1}) for the positions it has not seen yet (more than one
        # after cycles another drafter of a composite drafted, or plain steps; the prompt, or its
        # last ``context`` positions, at the first draft)
        if self.offset is None:
            self.offset = 0 if self.context is None else max(0, n - 1 - self.context)
        seen = self.offset + self.cache.length
        return self.drafting.grow(tokens[seen + 1:n], features[seen:n - 1], n - 1, self.cache, params,
                                  verifier, generator, stats, tokens[:n], depth, chain)


# -- prompt lookup ----------------------------------------------------------------------------------
class NGramSource:
    """Prompt lookup: find the latest earlier occurrence of the text's last ``k`` tokens (the
    longest ``k`` from ``max_ngram`` down to ``min_ngram`` that occurs) in the prompt and the output
    so far, and propose the up to ``tokens`` tokens that followed it, as a chain."""

    needs_features = False
    feature_layers = None
    model = None
    chains_only = True

    def __init__(self, *, min_ngram: int, max_ngram: int, tokens: int) -> None:
        if min_ngram > max_ngram:
            raise ConfigError(f"drafter 'ngram': min_ngram = {min_ngram} exceeds max_ngram = {max_ngram}")
        self.sizes = tuple(range(max_ngram, min_ngram - 1, -1))  # longest first
        self.max_depth = self.max_tokens = tokens

    def start(self, capacity: int) -> "NGramIndex":
        return NGramIndex(self.sizes, self.max_tokens)


class NGramIndex:
    """Every n-gram of the committed text, with the start of its latest occurrence that has a
    token after it; updated with the tokens committed since the last cycle."""

    def __init__(self, sizes: Sequence[int], tokens: int) -> None:
        self.sizes, self.limit = tuple(sizes), tokens
        self.text: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest usable occurrence
        self.indexed = 0  # n-grams ending before this index are in the table

    def extend(self, new: Sequence[int]) -> None:
        self.text.extend(int(t) for t in new)
        text, last = self.text, len(self.text) - 1
        # an n-gram is usable once a token follows it: those ending at indices < last
        for end in range(self.indexed, last):
            for k in self.sizes:
                if end + 1 >= k:
                    self.table[tuple(text[end + 1 - k:end + 1])] = end + 1 - k
        self.indexed = max(self.indexed, last)

    def lookup(self) -> tuple[list[int], int]:
        """The proposal after the committed text and the length of the n-gram it matched (0: none)."""
        text, n = self.text, len(self.text)
        for k in self.sizes:
            if n < k:
                continue
            start = self.table.get(tuple(text[n - k:]))
            if start is not None:
                return text[start + k:start + k + self.limit], k
        return [], 0

    def grow(self, tokens, features, n, params, verifier, generator, stats, depth=None) -> DraftTree:
        with stats.timed("lookup"):
            if n > len(self.text):
                self.extend(tokens[len(self.text):n].tolist())
            proposal, _ = self.lookup()
            return chain_tree(self.text[-1], proposal if depth is None else proposal[:depth], verifier,
                              tokens.device)


def chain_tree(root: int, proposal: Sequence[int], verifier, device) -> DraftTree:
    """A drafter without a model's proposal as a chain below ``root``; for a sampler, each child
    drawn from the one-point distribution on it (what keeps sampling lossless)."""
    tree = DraftTree.with_root(int(root))
    node = 0
    for token in proposal:
        if not verifier.prunes:
            tree.draft_probs[node] = (torch.tensor([token], device=device), torch.ones(1, device=device))
        node = tree.add(node, int(token), 0.0)
    return tree


# -- the target's own answers -----------------------------------------------------------------------
class CorpusSource:
    """Retrieval from a corpus of the target's own answers (:mod:`dynaspec.runtime.corpus`): after
    the text's last n-gram, the tokens the target most often wrote next in its answers to train
    prompts, as a chain, where the table is sure enough of them; no model."""

    needs_features = False
    feature_layers = None
    model = None
    chains_only = True

    def __init__(self, table, *, tokens: int, min_count: int, min_share: float) -> None:
        self.table, self.min_count, self.min_share = table, min_count, min_share
        self.max_depth = self.max_tokens = tokens

    def start(self, capacity: int) -> "CorpusSource":
        return self  # nothing of a generation is kept: the table and the text say it all

    def grow(self, tokens, features, n, params, verifier, generator, stats, depth=None) -> DraftTree:
        with stats.timed("lookup"):
            tail = tokens[max(0, n - self.table.sizes[0]):n].tolist()
            limit = self.max_tokens if depth is None else min(depth, self.max_tokens)
            proposal = self.table.propose(tail, limit, min_count=self.min_count, min_share=self.min_share)
            return chain_tree(tail[-1], proposal, verifier, tokens.device)


# -- several drafters -------------------------------------------------------------------------------
class CompositeSource:
    """Several drafters. In a chain stack, or when sampling, the first drafter whose tree is not
    empty drafts the cycle (so ``["ngram", "gemma3-270m"]`` copies where the text repeats and asks
    the trained drafter elsewhere). In a tree stack with the greedy verifier, every drafter drafts
    and their trees are merged: equal tokens below equal parents become one node."""

    def __init__(self, sources: Sequence[DraftSource], *, merge: bool) -> None:
        readers = [s for s in sources if s.needs_features]
        layers = {s.feature_layers for s in readers}
        if len(layers) > 1:
            raise ConfigError("drafter 'composite': its drafters read different target features "
                              f"({', '.join(str(x) for x in layers)}); one set of features is kept")
        self.sources, self.merge = tuple(sources), merge
        self.needs_features = bool(readers)
        self.feature_layers = readers[0].feature_layers if readers else None
        self.model = next((s.model for s in sources if getattr(s, "model", None) is not None), None)
        self.max_depth = max(s.max_depth for s in sources)
        self.max_tokens = (sum if merge else max)(s.max_tokens for s in sources)
        self.chains_only = not merge and all(s.chains_only for s in sources)

    def start(self, capacity: int) -> "_CompositeSession":
        return _CompositeSession([s.start(capacity) for s in self.sources], self.merge,
                                 costly=[getattr(s, "model", None) is not None for s in self.sources])


class _CompositeSession:
    """``costly_cap``: a depth for the drafters with a model only, set by the engine's cost planner
    before a cycle (0: they do not draft); a draft step of prompt lookup costs next to nothing, so
    only ``depth`` holds it. ``last_costly``: whether the last tree came from a drafter with a model."""

    def __init__(self, sessions, merge: bool, costly: Sequence[bool] = ()) -> None:
        self.sessions, self.merge = sessions, merge
        self.costly = list(costly) or [True] * len(sessions)
        self.costly_cap: int | None = None
        self.last_costly = False

    def grow(self, tokens, features, n, params, verifier, generator, stats, depth=None,
             chain=False) -> DraftTree:
        # a sampler's siblings must come from one distribution; a chain is one drafter's line
        merge = self.merge and verifier.prunes and not chain
        merged = None
        self.last_costly = False
        for index, session in enumerate(self.sessions):
            held = depth
            if self.costly[index] and self.costly_cap == 0:
                continue
            if self.costly[index] and self.costly_cap is not None:
                held = self.costly_cap if depth is None else min(depth, self.costly_cap)
            tree = grow_within(session, tokens, features, n, params, verifier, generator, stats, held, chain)
            if len(tree) == 1:
                continue
            stats.draft_sources[index] += 1
            self.last_costly = self.last_costly or self.costly[index]
            if not merge:
                return tree
            merged = tree if merged is None else merge_trees(merged, tree)
        return merged if merged is not None else DraftTree.with_root(int(tokens[n - 1]))


def grow_within(session, tokens, features, n, params, verifier, generator, stats,
                depth: int | None, chain: bool = False) -> DraftTree:
    """``session.grow`` at most ``depth`` positions deep: a session whose ``grow`` takes no ``depth``
    (a plugin written before it existed) drafts its own depth and the tree is cut. ``chain``: the
    caller keeps only the tree's first line, so a session whose ``grow`` takes ``chain`` drafts
    that line alone (others draft their tree, and the caller cuts it)."""
    takes = _TAKES.get(type(session))
    if takes is None:
        params_of = inspect.signature(session.grow).parameters
        takes = _TAKES[type(session)] = ("depth" in params_of, "chain" in params_of)
    extra = {"chain": True} if chain and takes[1] else {}
    if depth is None:
        return session.grow(tokens, features, n, params, verifier, generator, stats, **extra)
    if takes[0]:
        return session.grow(tokens, features, n, params, verifier, generator, stats, depth=depth, **extra)
    return session.grow(tokens, features, n, params, verifier, generator, stats, **extra).within(depth)


#: per session class: whether its ``grow`` takes ``depth``, and ``chain``
_TAKES: dict[type, tuple[bool, bool]] = {}


def merge_trees(first: DraftTree, second: DraftTree) -> DraftTree:
    """``first`` with ``second``'s nodes added below the same root: a node whose parent and token
    are already there is that node. Node order keeps parents before children; ``first``'s nodes
    keep their numbers and their children's order (its favourite lines stay first)."""
    out = DraftTree(tokens=list(first.tokens), parents=list(first.parents), depths=list(first.depths),
                    scores=list(first.scores), children={k: list(v) for k, v in first.children.items()},
                    draft_probs=dict(first.draft_probs))
    where = {0: 0}  # second's node -> out's node
    for node in range(1, len(second)):
        parent = where[second.parents[node]]
        token = second.tokens[node]
        same = [c for c in out.children.get(parent, []) if out.tokens[c] == token]
        where[node] = same[0] if same else out.add(parent, token, second.scores[node] - second.scores[
            second.parents[node]])
    return out

