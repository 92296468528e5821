"""Per-generation statistics."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Any

import attrs

#: Wall-time buckets of a generation: the prefill; drafting (lookup: prompt lookup's n-gram index;
#: embed, draft_core, router, head_gemm: a trained drafter);
#: verification (target_body: the target's pass over the drafted tokens; verify_head: its LM head
#: and the verifier); bookkeeping (cache compaction, committing tokens and features).
TIME_KEYS = ("prefill", "lookup", "embed", "draft_core", "router", "head_gemm", "target_body", "verify_head",
             "bookkeeping")
DRAFT_KEYS = ("lookup", "embed", "draft_core", "router", "head_gemm")


@attrs.define
class GenerationStats:
    """Counts and timings of one generation.

    ``accepted_lengths[c]`` is the number of tokens committed by cycle ``c`` (accepted drafts plus
    the bonus token), the definition of the paper and Spec-Bench; the first token, produced by the
    prefill, belongs to no cycle.
    """

    new_tokens: int = 0
    accepted_lengths: list[int] = attrs.field(factory=list)
    shortlist_sizes: dict[int, list[int]] = attrs.field(factory=lambda: defaultdict(list))
    times: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(TIME_KEYS, 0.0))
    wall_time: float = 0.0
    #: draft steps taken (one per depth of every cycle, whatever the number of tree rows)
    draft_steps: int = 0
    #: batched full-vocabulary head products computed by verification (one per cycle for a chain)
    verify_products: int = 0
    #: the target's time (body + head) of every cycle; for plain decoding, of every step
    verify_times: list[float] = attrs.field(factory=list)
    #: "guaranteed" or "not guaranteed": output equal to plain decoding by construction (the engine's
    #: numerics verdict), and its reason
    exactness: str = ""
    exactness_reason: str = ""
    #: per draft position p (1 = the first drafted token): in how many cycles the draft reached
    #: position p, and in how many of them verification accepted a token there
    drafted_at: list[int] = attrs.field(factory=list)
    accepted_at: list[int] = attrs.field(factory=list)
    #: cycles drafted by each drafter of a composite (by its index in the composite's list)
    draft_sources: Counter = attrs.field(factory=Counter)
    #: cycles in which the engine drafted nothing (the cost model's plain steps)
    plain_cycles: int = 0
    #: why generation ended: "stop" (EOS, end of turn or a stop text) or "length" (max_new_tokens)
    finish_reason: str = ""

    def record_acceptance(self, depth: int, accepted: int) -> None:
        """One cycle's draft reached ``depth`` positions and ``accepted`` of them were accepted."""
        count_positions(self.drafted_at, self.accepted_at, depth, accepted)

    @property
    def acceptance_per_position(self) -> list[float]:
        """For each draft position, the fraction of the drafts reaching it whose token there was
        accepted (which needs every earlier position accepted too, so it never rises with depth
        for drafts of one length)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @contextmanager
    def timed(self, key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[key] += time.perf_counter() - start

    @contextmanager
    def verification(self):
        """Around one verification (or one plain step): records the target's time spent in it
        (its ``target_body`` and ``verify_head`` buckets) in ``verify_times``."""
        before = self.verify_time
        try:
            yield
        finally:
            self.verify_times.append(self.verify_time - before)

    @property
    def draft_time(self) -> float:
        return sum(self.times[k] for k in DRAFT_KEYS)

    @property
    def verify_time(self) -> float:
        """The target's part of the cycles (plain decoding: of the steps): body + head."""
        return self.times["target_body"] + self.times["verify_head"]

    @property
    def cycles(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / self.cycles if self.cycles else 0.0

    @property
    def accepted_length_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_lengths).items()))

    @property
    def mean_shortlist_size(self) -> float:
        sizes = [s for per_depth in self.shortlist_sizes.values() for s in per_depth]
        return sum(sizes) / len(sizes) if sizes else 0.0

    @property
    def shortlist_size_per_depth(self) -> dict[int, float]:
        return {d: sum(v) / len(v) for d, v in sorted(self.shortlist_sizes.items()) if v}

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "cycles": self.cycles,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": {str(k): v for k, v in self.accepted_length_histogram.items()},
            "accepted_lengths": list(self.accepted_lengths),
            "mean_shortlist_size": self.mean_shortlist_size,
            "shortlist_size_per_depth": {str(k): v for k, v in self.shortlist_size_per_depth.items()},
            "times": dict(self.times),
            "wall_time": self.wall_time,
            "draft_steps": self.draft_steps,
            "verify_products": self.verify_products,
            "verify_times": list(self.verify_times),
            "tokens_per_second": self.tokens_per_second,
            "exactness": self.exactness,
            "exactness_reason": self.exactness_reason,
            "drafted_at": list(self.drafted_at),
            "accepted_at": list(self.accepted_at),
            "acceptance_per_position": self.acceptance_per_position,
            "draft_sources": {str(k): v for k, v in sorted(self.draft_sources.items())},
            "plain_cycles": self.plain_cycles,
            "finish_reason": self.finish_reason,
        }


def format_acceptance(values) -> str:
    """Per-position acceptance as ``0.81 0.62 0.44`` (``-``: nothing drafted)."""
    return " ".join(f"{v:.2f}" for v in values) or "-"


def count_positions(drafted: list[int], accepted: list[int], depth: int, upto: int) -> None:
    """Add one drafted cycle to per-position counts: it reached positions 1 to ``depth`` and was
    accepted at positions 1 to ``upto`` (both lists grow to ``depth`` as needed)."""
    for counts, n in ((drafted, depth), (accepted, upto)):
        if len(counts) < depth:
            counts.extend([0] * (depth - len(counts)))
        for p in range(n):
            counts[p] += 1
