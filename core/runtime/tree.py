"""The draft tree: node 0 is the root (the last committed token, not yet seen by the target);
every other node is a drafted token. A chain is a tree whose nodes have one child each."""

from __future__ import annotations

import attrs
import torch


@attrs.define
class DraftTree:
    """Drafted tokens with their parents, depths and cumulative draft log-probabilities.

    ``children[i]`` lists node ``i``'s children in the order they were proposed (for sampling
    verification this is the order they were sampled without replacement). ``draft_probs[i]``
    holds ``(token_ids or None, probs)``: the draft distribution node ``i``'s children were drawn
    from, on the shortlist (``None`` = full vocabulary); the sampling verifier needs it.
    """

    tokens: list[int]
    parents: list[int] = attrs.field(factory=lambda: [-1])
    depths: list[int] = attrs.field(factory=lambda: [-1])
    scores: list[float] = attrs.field(factory=lambda: [0.0])
    children: dict[int, list[int]] = attrs.field(factory=dict)
    draft_probs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = attrs.field(factory=dict)

    @classmethod
    def with_root(cls, token: int) -> "DraftTree":
        return cls(tokens=[int(token)])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, logq: float) -> int:
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] + float(logq))
        self.children.setdefault(parent, []).append(node)
        return node

    @property
    def is_chain(self) -> bool:
        """Every node has at most one child, in node order (node i's parent is node i - 1)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestors(self, node: int) -> list[int]:
        """``node`` and its ancestors up to (and including) the root, deepest first."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def keep_best(self, total: int, floor: float | None = None) -> "DraftTree":
        """The ``total`` highest-scoring drafted nodes (EAGLE-2 rerank), with the root; with
        ``floor`` (a log-probability), only those scoring at least ``floor`` besides the drafter's
        first line (the line of first children from the root), which stays as it is.

        Scores never increase from parent to child, and ties go to the shallower node, so the kept
        set is closed under ancestors.
        """
        ranked = sorted(range(1, len(self)), key=lambda i: (-self.scores[i], self.depths[i], i))[:total]
        if floor is not None:
            first = set(self.first_line())
            ranked = [i for i in ranked if i in first or self.scores[i] >= floor]
        return self._subtree(sorted([0, *ranked], key=lambda i: (self.depths[i], i)), leaf_probs=True)

    def first_line(self, node: int = 0) -> list[int]:
        """``node`` and the line below it that the drafter put first: its first child, that
        child's first child, and so on."""
        line = [node]
        while self.children.get(line[-1]):
            line.append(self.children[line[-1]][0])
        return line

    def line(self) -> "DraftTree":
        """The drafter's first line alone (:meth:`first_line` from the root), as a chain."""
        return self if self.is_chain else self._subtree(self.first_line(), leaf_probs=False)

    def within(self, positions: int) -> "DraftTree":
        """The tree cut to its first ``positions`` draft positions (nodes deeper are dropped; a
        node left without children keeps no draft distribution)."""
        if positions < 0:
            raise ValueError(f"positions must be >= 0, got {positions}")
        if max(self.depths) < positions:
            return self
        return self._subtree([i for i in range(len(self)) if self.depths[i] < positions], leaf_probs=False)

    def _subtree(self, keep: list[int], *, leaf_probs: bool) -> "DraftTree":
        """The nodes ``keep`` (the root first, parents before children, closed under ancestors),
        renumbered; ``leaf_probs``: a kept node left without children keeps its draft distribution."""
        remap = {old: new for new, old in enumerate(keep)}
        out = DraftTree(tokens=[self.tokens[i] for i in keep],
                        parents=[remap.get(self.parents[i], -1) for i in keep],
                        depths=[self.depths[i] for i in keep],
                        scores=[self.scores[i] for i in keep])
        for old in keep:
            kids = [remap[c] for c in self.children.get(old, []) if c in remap]
            if kids:
                out.children[remap[old]] = kids
            if old in self.draft_probs and (kids or leaf_probs):
                out.draft_probs[remap[old]] = self.draft_probs[old]
        return out

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [N, N]: node i may attend to node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool, device=device)
        for i in range(1, n):  # parents come before their children: their rows are complete
            mask[i] |= mask[self.parents[i]]
        return mask
