"""Whether to draft this cycle: speculation that never runs slower than plain decoding for long.

Drafting pays when the tokens a cycle commits outweigh what the cycle costs: the draft and a
verification over several rows, against one plain step per token. Both sides depend on the
machine (the row costs of its kernels) and on the text (how often drafts are accepted: retrieval
and summaries that copy from the prompt defeat a drafter trained on open answers). So the engine
measures both as it decodes:

* the plain step's time, an exponential average over the plain steps this engine has taken (on
  the first generation, before any, the shortest verification seen stands in for it: a plain step
  never costs more than a verification, so this errs towards drafting);
* the drafted cycles' rate, committed tokens per second of draft plus verification, an
  exponential average over this generation's drafted cycles.

While the drafted rate stays below the plain rate, the gate takes ``backoff`` plain steps, then
drafts one cycle again to look; each failed look doubles ``backoff`` (up to ``MAX_BACKOFF``), and a
look that pays resets it. When drafting pays, the gate only compares two numbers per cycle.

That is ``draft.planner = "rate"``. ``draft.planner = "cost"`` (:class:`CostPlanner`) decides
each cycle's depth, not only whether to draft, from a cost model: the machine's measured costs (a
plain step, a verification by the number of rows, a draft step) against the expected tokens of a
chain capped at each depth, from this generation's acceptance per draft position (with the
engine's earlier generations as a prior). It drafts where it expects more tokens per second than
a plain step gives, at the depth that expects the most, and looks again after backing off as the
rate planner does. ``draft.planner = "cost-gate"`` takes from the same model only the decision
whether to draft, and drafts the stack's whole depth when it does; ``"auto"`` is ``"cost-gate"``
where the target verifies a tree's rows for about the cost of one, else ``"cost"``.

The constants were chosen on train prompts (``dynaspec bench`` over the training questions), never
on the prompts the results report.
"""

from __future__ import annotations

import attrs

from dynaspec.runtime.stats import count_positions

#: weight of the newest cycle in the exponential averages
ALPHA = 0.5
#: drafted cycles seen in a generation before the gate may stop drafting
WARMUP = 2
#: plain steps after the first failed look, and the most after repeated failures
FIRST_BACKOFF, MAX_BACKOFF = 4, 64


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class PlainCost:
    """What steps cost on this machine, shared by an engine's generations: the plain step, and
    for the cost planner a verification by its number of rows, a draft step, and the acceptance
    per draft position over every generation so far."""

    def __init__(self) -> None:
        self.seconds: float | None = None  # measured plain steps
        self.bound: float | None = None  # the shortest verification seen: an upper bound
        self.by_rows: dict[int, float] = {}  # verification seconds by rows verified (2 or more)
        self.draft_step: float | None = None  # seconds per drafted position
        self.drafted: list[int] = []  # every generation's drafted cycles reaching each position
        self.accepted: list[int] = []  # ... and accepted through it
        self.overhead: float | None = None  # a cycle's seconds outside drafting and the target

    def record_plain(self, seconds: float) -> None:
        self.seconds = _ema(self.seconds, seconds)

    def record_verification(self, seconds: float, rows: int | None = None) -> None:
        self.bound = seconds if self.bound is None else min(self.bound, seconds)
        if rows is not None and rows > 1:
            self.by_rows[rows] = _ema(self.by_rows.get(rows), seconds)

    def record_overhead(self, seconds: float) -> None:
        self.overhead = _ema(self.overhead, max(0.0, seconds))

    def record_draft(self, seconds: float, positions: int) -> None:
        if positions > 0:
            self.draft_step = _ema(self.draft_step, seconds / positions)

    @property
    def estimate(self) -> float | None:
        return self.seconds if self.seconds is not None else self.bound

    def verification(self, rows: int) -> float | None:
        """Seconds to verify ``rows`` rows: measured (one row: the plain step), else interpolated
        between the nearest row counts measured, else extended from the largest along the line
        from one row to it. None before anything is measured."""
        plain = self.estimate  # set by any verification, so known whenever ``by_rows`` is not empty
        if plain is None or rows <= 1:
            return plain
        if rows in self.by_rows:
            return self.by_rows[rows]
        below = max((r for r in self.by_rows if r < rows), default=1)
        above = min((r for r in self.by_rows if r > rows), default=None)
        cost = self.by_rows.get(below, plain)
        if above is None:  # beyond the largest measured: along the line from one row
            slope = max(0.0, (cost - plain) / (below - 1)) if below > 1 else 0.0
            return cost + slope * (rows - below)
        w = (rows - below) / (above - below)
        return (1 - w) * cost + w * self.by_rows[above]


class DraftGate:
    """One generation's decision, cycle by cycle, to draft or to take a plain step."""

    def __init__(self, plain: PlainCost) -> None:
        self.plain = plain
        self.rate: float | None = None  # drafted cycles: committed tokens per second
        self.drafted = 0
        self.wait = 0  # plain steps still to take before the next look
        self.backoff = FIRST_BACKOFF

    def draft_now(self) -> bool:
        return self.wait == 0

    def record(self, *, drafted: bool, tokens: int, seconds: float, verify_seconds: float) -> None:
        """One cycle: whether it drafted, the tokens it committed, its time (draft and target) and
        the target's part of it."""
        if not drafted:
            self.plain.record_plain(seconds)
            if self.wait:
                self.wait -= 1
                if self.wait == 0:
                    self.rate = None  # the next drafted cycle is a fresh look
            return
        self.plain.record_verification(verify_seconds)
        rate = tokens / seconds if seconds > 0 else float("inf")
        looking = self.rate is None and self.drafted >= WARMUP
        self.rate = rate if self.rate is None else (1 - ALPHA) * self.rate + ALPHA * rate
        self.drafted += 1
        cost = self.plain.estimate
        if cost is None or self.drafted < WARMUP:
            return
        if self.rate * cost < 1.0:  # drafted tokens per second below the plain steps'
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        elif looking:
            self.backoff = FIRST_BACKOFF


@attrs.define(eq=False)
class DepthControl:
    """A caller's hold on one generation's draft depth, cycle by cycle, and what its drafts earned.

    A server that verifies several requests in one pass sets ``limit`` before each cycle (see
    ``dynaspec.serving.planner``): ``None`` drafts as the stack says, ``0`` takes a plain step, ``k``
    drafts at most ``k`` positions. Greedy output does not depend on it: only what is proposed
    changes, never what is verified. The generation counts, per draft position, the drafted cycles
    that drafted it and those in which it was accepted."""

    limit: int | None = None
    drafted: list[int] = attrs.field(factory=list)
    accepted: list[int] = attrs.field(factory=list)
    #: consecutive cycles this generation was held to a plain step
    held: int = 0
    #: cycles it was granted some draft positions but not all (every ``EXPLORE_EVERY``-th drafts one more)
    capped: int = 0

    def record(self, depth: int, accepted: int) -> None:
        """A drafted cycle reached ``depth`` positions and ``accepted`` of them were accepted."""
        count_positions(self.drafted, self.accepted, depth, accepted)


#: default weight (in drafted cycles) of the engine's earlier generations in a generation's
#: acceptance (``draft.planner_prior``)
PRIOR_WEIGHT = 2.0
#: acceptance assumed at a draft position no generation has reached yet, given the one before
UNSEEN_ACCEPTANCE = 0.5
#: drafted cycles at that assumed acceptance which the pooled count of each position starts from:
#: without them two early failures at a position would set its pooled acceptance to 0, the planner
#: would never draft that deep again, and so never learn otherwise
POOL_PRIOR = 4.0
#: a generation capped below its stack's depth drafts one position deeper on every
#: ``EXPLORE_EVERY``-th capped cycle, so the positions beyond its cap stay measured
EXPLORE_EVERY = 8


def pooled_share(accepted: float, drafted: float, before: float) -> float:
    """The pooled acceptance at a draft position from its counts over every generation, starting
    from ``POOL_PRIOR`` drafts at ``UNSEEN_ACCEPTANCE`` of ``before`` (the estimate at the position
    before)."""
    return (accepted + POOL_PRIOR * UNSEEN_ACCEPTANCE * before) / (drafted + POOL_PRIOR)


def explore(limit: int, max_depth: int, capped: int) -> tuple[int, int]:
    """A cycle held to ``limit`` positions (0 < limit < max_depth) after ``capped`` such cycles:
    the limit it drafts at (one position deeper every ``EXPLORE_EVERY``-th, so the positions beyond
    a cap stay measured) and the new count."""
    capped += 1
    return (limit + 1 if capped % EXPLORE_EVERY == 0 else limit), capped


class CostPlanner:
    """One generation's depth, cycle by cycle, from the cost model (``draft.planner = "cost"``).

    ``cap(max_depth)`` before a cycle: ``None`` drafts as the stack says (until the costs and some
    acceptance are measured, and for a look after backing off), ``0`` takes a plain step, ``k``
    drafts at most ``k`` positions. The chosen ``k`` maximises the expected tokens per second
    ``(1 + s_1 + ... + s_k) / (k * draft_step + verification(k + 1) + overhead)``, where ``s_j`` is
    the chance that a chain reaching position ``j`` is accepted through it (this generation's
    counts with ``prior_weight`` cycles of the engine's earlier generations mixed in, those with
    ``POOL_PRIOR`` cycles at ``UNSEEN_ACCEPTANCE``; counted over the cycles that a drafter with a
    model drafted) and ``overhead`` a cycle's bookkeeping. Every ``EXPLORE_EVERY``-th cycle capped
    below the stack's depth drafts one position more, so the cap follows what deeper positions
    earn instead of what a few early cycles measured. A plain
    step's rate is ``1 / (plain + overhead)``; where no depth beats it, the planner takes
    ``backoff`` plain steps and then drafts one cycle to look again, doubling ``backoff`` after
    each look that leaves drafting behind (up to ``MAX_BACKOFF``) and resetting it after one that
    does not. In a composite the depth holds only the drafters with a model: prompt lookup's
    proposals, which cost next to nothing to draft, stay uncut, and still come while the others
    are held to plain steps. With ``whole_depth`` (``planner = "cost-gate"``, and ``"auto"`` where a
    tree's rows cost about one) the model only decides whether to draft: a cycle that drafts
    drafts as deep as the stack says.
    """

    def __init__(self, costs: PlainCost, prior_weight: float = PRIOR_WEIGHT, whole_depth: bool = False) -> None:
        self.costs = costs
        self.prior_weight = prior_weight
        self.whole_depth = whole_depth
        self.drafted: list[int] = []  # this generation's drafted cycles reaching each position
        self.accepted: list[int] = []  # ... and accepted through it
        self.wait = 0  # plain steps still to take
        self.backoff = FIRST_BACKOFF
        self.look_next = False
        self.looking = False
        self.max_depth = 1
        self.capped = 0  # drafted cycles capped below the stack's depth

    def acceptance(self, depth: int) -> list[float]:
        """``s_1 .. s_depth`` for this generation (never rising with depth)."""
        out, prev = [], 1.0
        for j in range(depth):
            seen_d = self.costs.drafted[j] if j < len(self.costs.drafted) else 0
            seen_a = self.costs.accepted[j] if j < len(self.costs.accepted) else 0
            prior = pooled_share(seen_a, seen_d, prev)
            d = self.drafted[j] if j < len(self.drafted) else 0
            a = self.accepted[j] if j < len(self.accepted) else 0
            prev = min(prev, (a + self.prior_weight * prior) / (d + self.prior_weight))
            out.append(prev)
        return out

    def best_depth(self, max_depth: int) -> int | None:
        """The depth expected to commit the most tokens per second (0: a plain step), or None
        while a cost it needs is unmeasured or no draft has been verified yet."""
        plain, step = self.costs.estimate, self.costs.draft_step
        if plain is None or step is None or not self.costs.drafted:
            return None
        extra = self.costs.overhead or 0.0
        best, best_rate, expected = 0, 1.0 / (plain + extra), 1.0
        for k, s in enumerate(self.acceptance(max_depth), start=1):
            expected += s
            rate = expected / (k * step + self.costs.verification(k + 1) + extra)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def cap(self, max_depth: int) -> int | None:
        self.max_depth = max(1, max_depth)
        if self.wait:
            return 0
        if self.look_next:
            self.look_next, self.looking = False, True
            return None
        best = self.best_depth(self.max_depth)
        if best == 0:
            self.wait = self.backoff  # this cycle is the first of them
        elif self.whole_depth:
            return None  # drafting pays: as deep as the stack drafts
        elif best is not None and best < self.max_depth:
            best, self.capped = explore(best, self.max_depth, self.capped)
        return best

    def record(self, *, drafted: bool, seconds: float, verify_seconds: float, rows: int = 1,
               draft_seconds: float = 0.0, reached: int = 0, accepted: int = 0, costly: bool = True) -> None:
        """One cycle: whether it drafted, its time in all, the target's part of it and the rows
        it verified; for a drafted cycle, the drafting's seconds, the positions its draft reached,
        how many of them were accepted, and whether a drafter with a model drafted it (only those
        cycles measure a draft step: prompt lookup's cost next to nothing)."""
        self.costs.record_overhead(seconds - verify_seconds - draft_seconds)
        if drafted:
            self.costs.record_verification(verify_seconds, rows)
        else:
            self.costs.record_plain(verify_seconds)
        if not (drafted and costly):  # the drafters with a model did not draft (prompt lookup may have)
            if self.wait:
                self.wait -= 1
                self.look_next = self.wait == 0
            return
        self.costs.record_draft(draft_seconds, reached)
        count_positions(self.drafted, self.accepted, reached, accepted)
        count_positions(self.costs.drafted, self.costs.accepted, reached, accepted)
        if self.looking:
            self.looking = False
            paid = self.best_depth(self.max_depth) != 0
            self.backoff = FIRST_BACKOFF if paid else min(2 * self.backoff, MAX_BACKOFF)
