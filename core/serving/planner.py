"""How deep each request drafts when several requests share the target's passes.

Alone, a request drafts as its stack says: on this CPU a verification of a few rows costs about one
plain step, so its drafted rows are nearly free. In a batch they are not. Every request's rows go
through the target together, and drafting itself runs request by request, so each drafted row
costs the whole batch time. With many requests, deep drafts with low acceptance make every
request slower than plain decoding batched the same way.

The planner measures, as the server runs:

* **the cycle's cost**: seconds ~ ``fixed + per_request * B + per_row * E`` for ``B`` requests in
  the pass and ``E`` drafted rows verified (drafting grows with those rows too). A weighted least
  squares over the last ``WINDOW`` cycles, newer ones weighing more (``DECAY`` per cycle); cycles in
  which a request joined (its prefill ran inside) are left out.
* **each request's acceptance per draft position**: ``a[j]``, the share of its drafted cycles that
  drafted position ``j`` and accepted it (:class:`~dynaspec.runtime.gate.DepthControl`). The pooled
  share of every request so far weighs as ``PRIOR_DRAFTS`` drafts while a request has few of its own.

Until both are measured, every request of a batch drafts one position a cycle (the cheapest draft
that measures them; a request alone drafts as its stack says). A position's pooled share starts
from ``POOL_PRIOR`` drafts at ``UNSEEN_ACCEPTANCE`` of the one before (both in
:mod:`dynaspec.runtime.gate`), and a request granted some
positions but not all drafts one more every ``EXPLORE_EVERY``-th such cycle, so that positions
beyond the grants stay measured. Then each cycle it grants draft
positions, best ``a`` first (a request's positions in order), as far as
they raise the batch's expected tokens per second, ``(B + sum of granted a) / (fixed + per_request
* B + per_row * granted)``. A request granted all its positions drafts as its stack says (its own
stop rules and gate); one granted none takes a plain step. A request held to plain steps for
``PROBE_EVERY`` cycles times the requests in the batch drafts one cycle in full, so that its
acceptance stays measured, and no more than one request probes in a cycle: a probe costs the whole
batch one request's draft (its drafter first catches up on every token it skipped), so the batch
as a whole probes about once every ``PROBE_EVERY`` cycles, whatever its size.

Greedy output does not depend on any of this: the depth changes what is proposed, never what is
verified. The constants were set by reasoning about the estimators, not tuned on prompts.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from dynaspec.runtime.gate import DepthControl, explore, pooled_share

#: cycles the cost fit reads, and each older cycle's weight relative to the next
WINDOW, DECAY = 64, 0.95
#: cycles measured (and the spread of their drafted rows) before the planner limits anything
MIN_CYCLES, MIN_ROW_SPREAD = 8, 2
#: how many drafts the pooled acceptance weighs as in a request's own estimate
PRIOR_DRAFTS = 4
#: plain cycles in a row, per request in the batch, after which a held request drafts one cycle in full
PROBE_EVERY = 16


class CycleCosts:
    """The batched cycle's time as ``fixed + per_request * B + per_row * E``, fitted on the last
    cycles."""

    def __init__(self) -> None:
        self.cycles: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        #: the last fit the window could make: kept while the window cannot make one
        self._last: tuple[float, float, float] | None = None

    def observe(self, requests: int, rows: int, seconds: float) -> None:
        """One cycle: ``requests`` in the pass, ``rows`` drafted rows verified, its wall time."""
        if requests > 0 and seconds > 0:
            self.cycles.append((requests, rows, seconds))

    @property
    def ready(self) -> bool:
        rows = [e for _, e, _ in self.cycles]
        return len(rows) >= MIN_CYCLES and max(rows) - min(rows) >= MIN_ROW_SPREAD

    def fit(self) -> tuple[float, float, float] | None:
        """``(fixed, per_request, per_row)`` in seconds, or None while too little is measured. A
        direction the cycles did not vary in (every pass holding the same number of requests) gets
        the least-norm answer, which predicts those cycles as well as any other. A window whose
        drafted rows no longer vary (every request held to plain steps for ``WINDOW`` cycles) says
        nothing of what a row costs: the last fit holds then, or the planner would let every
        request draft in full again just because it had held them."""
        if not self.ready:
            return self._last
        data = np.array(self.cycles, dtype=np.float64)
        weights = np.sqrt(DECAY ** np.arange(len(data) - 1, -1, -1))
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]]) * weights[:, None]
        y = data[:, 2] * weights
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        self._last = float(coef[0]), float(coef[1]), max(0.0, float(coef[2]))
        return self._last


class DepthPlanner:
    """Each cycle's draft limits for the requests of a batch."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.costs = CycleCosts()
        #: per draft position: drafts and acceptances of the requests that have left
        self._drafted = np.zeros(max_depth)
        self._accepted = np.zeros(max_depth)

    def retire(self, control: DepthControl) -> None:
        """A request left: its counts join the pooled acceptance."""
        d, a = _counts(control, self.max_depth)
        self._drafted += d
        self._accepted += a

    def acceptance(self, controls: Sequence[DepthControl]) -> np.ndarray | None:
        """``[requests, max_depth]``: each request's estimated acceptance per draft position (never
        rising with depth), or None before any draft was verified."""
        counts = [_counts(c, self.max_depth) for c in controls]
        drafted = self._drafted + sum(d for d, _ in counts)
        accepted = self._accepted + sum(a for _, a in counts)
        if drafted[0] == 0:
            return None
        # each position's pooled share starts from POOL_PRIOR drafts at UNSEEN_ACCEPTANCE of the one
        # before: a position no request reached yet, or that a few early drafts failed at, is not
        # written off for good (it would never be granted again, and so never measured again)
        pooled, prev = np.zeros(self.max_depth), 1.0
        for j in range(self.max_depth):
            prev = pooled[j] = min(prev, pooled_share(accepted[j], drafted[j], prev))
        rows = [(a + PRIOR_DRAFTS * pooled) / (d + PRIOR_DRAFTS) for d, a in counts]
        return np.minimum.accumulate(np.array(rows), axis=1)

    def plan(self, controls: Sequence[DepthControl]) -> list[int | None]:
        """Set and return each request's limit for the next cycle (None: as its stack says)."""
        limits = self.choose(controls)
        due = PROBE_EVERY * len(controls)
        # the request held longest looks again once it is due (its acceptance may have changed)
        held = [i for i, limit in enumerate(limits) if limit == 0 and controls[i].held + 1 >= due]
        if held:
            limits[max(held, key=lambda i: controls[i].held)] = None
        for control, limit in zip(controls, limits):
            control.held = control.held + 1 if limit == 0 else 0
            if limit is not None and 0 < limit < self.max_depth:
                limit, control.capped = explore(limit, self.max_depth, control.capped)
            control.limit = limit
        return [c.limit for c in controls]

    def choose(self, controls: Sequence[DepthControl]) -> list[int | None]:
        """The limits that maximise the batch's expected tokens per second (no probing)."""
        if len(controls) == 1:
            return [None]  # alone, a request drafts as its stack says
        fit, rates = self.costs.fit(), self.acceptance(controls)
        if fit is None or rates is None:
            # not measured yet: one position each, the cheapest draft that measures both
            return [1] * len(controls)
        fixed, per_request, per_row = fit
        base = max(fixed + per_request * len(controls), 1e-9)
        return grant(rates, base, per_row)


def grant(rates: np.ndarray, base: float, per_row: float) -> list[int | None]:
    """Grant draft positions (``rates[i, j]``: request i's expected accepted tokens at position
    j + 1, non-increasing in j) best first, keeping the prefix that maximises ``(requests + granted
    rates) / (base + per_row * granted)``; a request granted all its positions gets None."""
    requests, depth = rates.shape
    order = sorted(((-rates[i, j], j, i) for i in range(requests) for j in range(depth)))
    tokens, best, best_k = float(requests), requests / base, 0
    for k, (neg, _, _) in enumerate(order, start=1):
        tokens -= neg
        rate = tokens / (base + per_row * k)
        if rate > best * (1 + 1e-12):  # a tie adds no row
            best, best_k = rate, k
    limits = [0] * requests
    for _, _, i in order[:best_k]:
        limits[i] += 1
    return [None if n == depth else n for n in limits]


def _counts(control: DepthControl, depth: int) -> tuple[np.ndarray, np.ndarray]:
    d, a = np.zeros(depth), np.zeros(depth)
    n = min(depth, len(control.drafted))
    d[:n] = control.drafted[:n]
    m = min(depth, len(control.accepted))
    a[:m] = control.accepted[:m]
    return d, a
