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


class PlainCost:
    """The plain step's time on this machine, shared by an engine's generations."""

    def __init__(self) -> None:
        self.seconds: float | None = None  # measured plain steps
        self.bound: float | None = None  # the shortest verification seen: an upper bound

    def record_plain(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else (1 - ALPHA) * self.seconds + ALPHA * seconds

    def record_verification(self, seconds: float) -> None:
        self.bound = seconds if self.bound is None else min(self.bound, seconds)

    @property
    def estimate(self) -> float | None:
        return self.seconds if self.seconds is not None else self.bound


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

    def record(self, depth: int, accepted: int) -> None:
        """A drafted cycle reached ``depth`` positions and ``accepted`` of them were accepted."""
        count_positions(self.drafted, self.accepted, depth, accepted)
