"""The draft phase of one cycle: grow a chain or an EAGLE-2 tree below the last committed token.

At each draft depth the scheduler gives a budget, the shortlister proposes the vocabulary rows,
the backend multiplies the drafter's state by those rows only, and the verifier chooses the
children (greedy top-k, or draws for lossless sampling). A draft stops at ``draft.depth``, or
earlier once the drafter's probability of its likeliest line falls below ``draft.min_confidence``;
a tree (greedy) also keeps only the side lines it gives at least that probability.
"""

from __future__ import annotations

import inspect
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from dynaspec.runtime.config import DraftConfig
from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.tree import DraftTree
from dynaspec.runtime.types import DraftStep, Shortlist


def _propose_without_grad(shortlister, step: DraftStep, scheduler):
    with torch.inference_mode():  # grad mode is per thread: the worker does not inherit it
        return shortlister.propose(step, scheduler)


class Drafting:
    """The drafter with the stack's shortlister, scheduler and backend, drafting one tree a cycle."""

    def __init__(self, cfg: DraftConfig, target, drafter: Drafter, shortlister, scheduler, backend) -> None:
        self.cfg, self.target, self.drafter = cfg, target, drafter
        self.shortlister, self.scheduler, self.backend = shortlister, scheduler, backend
        self._router_pool: ThreadPoolExecutor | None = None  # made on first use (router_overlap)
        #: whether the drafter computes the last position's output alone (``last=True``; a plugin's
        #: model written before it existed computes every position's)
        self._last = "last" in inspect.signature(drafter.forward).parameters
        #: a drafter with a vocabulary of its own (EAGLE-3): the head row of each target id, or -1
        self._row_of: torch.Tensor | None = None
        if drafter.vocabulary is not None:
            vocab = drafter.vocabulary
            self._row_of = torch.full((target.vocab_size,), -1, dtype=torch.long, device=vocab.device)
            self._row_of[vocab] = torch.arange(vocab.numel(), device=vocab.device)

    def _head_rows(self, shortlist: Shortlist) -> tuple[Shortlist, torch.Tensor | None]:
        """The shortlist as rows of the draft head, and the target id of each row (None: the
        target's whole vocabulary). With a drafter vocabulary of its own, the full shortlist is all
        of it and any other is kept where it falls inside it (all of it, if nothing does)."""
        if self._row_of is None:
            return shortlist, shortlist.token_ids
        vocab = self.drafter.vocabulary
        if shortlist.is_full:
            return Shortlist.full(), vocab
        rows = self._row_of[shortlist.token_ids.to(self._row_of.device)]
        rows = rows[rows >= 0]
        if rows.numel() == 0:
            return Shortlist.full(), vocab
        return Shortlist(rows), vocab[rows]

    def grow(self, fresh_tokens, fresh_features, root_pos, dcache, params, verifier, generator,
             stats, context, depth: int | None = None, chain: bool = False) -> DraftTree:
        """Grow the draft tree below the root (the last committed token), at most ``depth``
        positions deep (``None``: the stack's ``draft.depth``); ``chain``: one node per depth
        whatever ``draft.topk`` says (greedy: a batch verifies a granted request's first line only)."""
        cfg, target, drafter = self.cfg, self.target, self.drafter
        topk = 1 if chain and verifier.prunes else cfg.topk
        steps = cfg.depth if depth is None else max(1, min(cfg.depth, depth))
        device, dtype = target.device, drafter.fc.weight.dtype
        with stats.timed("embed"):
            emb = target.embed(fresh_tokens).to(dtype)
        feats = drafter.project(fresh_features.to(dtype))  # fused target layers: projected once
        positions = torch.arange(root_pos - len(fresh_tokens) + 1, root_pos + 1, device=device)
        step = DraftStep(depth=0, tokens=fresh_tokens[-1:], token_embeddings=emb[-1:],
                         prev_hidden=feats[-1:], context=context)
        routing = self._start_routing(step)
        with stats.timed("draft_core"):
            # the positions before the last only enter the cache (the prompt at a first draft,
            # the tokens committed since the last): their outputs are not needed
            out = (drafter(emb[None], feats[None], positions[None], cache=dcache, last=True)[0] if self._last
                   else drafter(emb[None], feats[None], positions[None], cache=dcache)[0][-1:])
        base = dcache.length
        tree = DraftTree.with_root(int(fresh_tokens[-1]))
        floor = math.log(cfg.min_confidence) if cfg.min_confidence > 0 else -math.inf
        frontier: list[int] = [0]
        slots: dict[int, int] = {}  # tree node -> its entry in the drafter cache (beyond `base`)
        for depth in range(steps):
            counts = self._child_counts(tree, len(frontier), depth, verifier, topk)
            if not any(counts):
                break
            stats.draft_steps += 1
            with stats.timed("router"):  # with router_overlap, only the wait that was not hidden
                shortlists = routing() if routing else self.shortlister.propose(step, self.scheduler)
                routing = None
            groups = ([(shortlists, list(range(len(frontier))))] if isinstance(shortlists, Shortlist)
                      else [(sl, [row]) for row, sl in enumerate(shortlists)])
            new_nodes, parent_row = [], {}
            for shortlist, rows in groups:
                head_rows, token_ids = self._head_rows(shortlist)
                size = target.vocab_size if token_ids is None else int(token_ids.numel())
                stats.shortlist_sizes[depth].extend([size] * len(rows))
                with stats.timed("head_gemm"):
                    logits = self.backend.logits(drafter.head_input(out[rows]), head_rows)
                idx, logq, probs = verifier.propose(logits, max(counts[r] for r in rows), params,
                                                    generator)
                ids = idx if token_ids is None else token_ids[idx]
                for i, row in enumerate(rows):
                    node = frontier[row]
                    if probs is not None:
                        tree.draft_probs[node] = (token_ids, probs[i])
                    for tok, lq in zip(ids[i, : counts[row]].tolist(), logq[i, : counts[row]].tolist()):
                        child = tree.add(node, tok, lq)
                        new_nodes.append(child)
                        parent_row[child] = row
            if depth == steps - 1 or self._confidence(tree, new_nodes) < cfg.min_confidence:
                break
            # expand the best new nodes: feed (token, parent's predicted feature) to the drafter;
            # in a tree, only lines the drafter still gives min_confidence (the best one always)
            frontier = sorted(new_nodes, key=lambda n: (-tree.scores[n], n))[:topk]
            if topk > 1 and verifier.prunes:
                frontier = frontier[:1] + [n for n in frontier[1:] if tree.scores[n] >= floor]
            toks = torch.tensor([tree.tokens[n] for n in frontier], device=device)
            feats = out[torch.tensor([parent_row[n] for n in frontier], device=device)]
            with stats.timed("embed"):
                emb = target.embed(toks).to(dtype)
            start = dcache.length
            # with one node per depth the drafter's new cache entries are exactly the frontier's
            # ancestors, so the causal mask it builds itself is right; a tree needs its own
            mask = None
            if topk > 1:
                mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool, device=device)
                mask[:, :base] = True  # the committed context, root included
                for row, node in enumerate(frontier):
                    mask[row, [slots[a] for a in tree.ancestors(node)[1:] if a in slots]] = True
                    mask[row, start + row] = True
            for row, node in enumerate(frontier):
                slots[node] = start + row
            positions = torch.full((1, len(frontier)), root_pos + 1 + depth, device=device)
            step = DraftStep(depth=depth + 1, tokens=toks, token_embeddings=emb, prev_hidden=feats,
                             context=context)
            routing = self._start_routing(step)
            with stats.timed("draft_core"):
                out = drafter(emb[None], feats[None], positions, cache=dcache, mask=mask)[0]
        if routing:
            routing()  # a step that was routed but not drafted: finish it before returning
        dcache.crop(base)
        if not verifier.prunes:
            return tree
        # a tree verifies its best nodes, and none whose line the drafter gives less than
        # min_confidence beyond its first line (each row costs the target some compute)
        return tree.keep_best(cfg.total_tokens, floor=floor if topk > 1 else None)

    @staticmethod
    def _confidence(tree: DraftTree, new_nodes: list[int]) -> float:
        """The drafter's probability of its likeliest new line: the product of the draft
        probabilities from the root down to the best node just drafted."""
        return math.exp(max(tree.scores[n] for n in new_nodes)) if new_nodes else 0.0

    def _start_routing(self, step: DraftStep):
        """With ``draft.router_overlap = "thread"``, start proposing the shortlist of ``step`` on a
        worker thread (the router reads only E(x_t) and the previous feature, so it can run beside
        the draft decoder layer) and return a function that waits for it; otherwise None, and the
        shortlist is proposed inline when it is needed."""
        if self.cfg.router_overlap != "thread":
            return None
        if self._router_pool is None:
            self._router_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynaspec-router")
        future = self._router_pool.submit(_propose_without_grad, self.shortlister, step, self.scheduler)
        return future.result

    def _child_counts(self, tree: DraftTree, n_frontier: int, depth: int, verifier, topk: int) -> list[int]:
        """How many children each frontier node gets at this depth."""
        cfg = self.cfg
        if verifier.prunes:
            return [topk] * n_frontier
        # The lossless sampler keeps every child it drew, so the node budget is spread over the
        # depths up front; counts depend only on sizes, never on which tokens were drawn.
        remaining = cfg.total_tokens - (len(tree) - 1)
        per_depth = remaining // (cfg.depth - depth)
        each = min(cfg.topk, per_depth // n_frontier)
        if each:
            return [each] * n_frontier
        return [1 if row < per_depth else 0 for row in range(n_frontier)]
