"""Prometheus metrics of a server: requests, tokens, acceptance, and where a cycle's time goes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynaspec.runtime.stats import GenerationStats

#: cycle time buckets as the metric names them, and the statistics' time keys in each
PHASES = {"draft": ("lookup", "embed", "draft_core", "router", "head_gemm"), "body": ("target_body",),
          "head": ("verify_head",), "bookkeeping": ("bookkeeping",), "prefill": ("prefill",)}


class Metrics:
    """The server's metrics, in a registry of their own (so that tests can start several apps)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dynaspec_requests", "requests answered, by route and outcome",
                                ["route", "outcome"], registry=r)
        self.running = Gauge("dynaspec_requests_running", "requests being generated", registry=r)
        self.queued = Gauge("dynaspec_requests_queued", "requests waiting for the engine", registry=r)
        self.prompt_tokens = Counter("dynaspec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("dynaspec_generation_tokens", "tokens generated", registry=r)
        self.accepted_length = Histogram("dynaspec_accepted_length", "tokens committed per cycle",
                                         buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16), registry=r)
        self.drafted = Counter("dynaspec_drafted_tokens", "drafts reaching each draft position",
                               ["position"], registry=r)
        self.accepted = Counter("dynaspec_accepted_tokens", "drafted tokens accepted, by draft position",
                                ["position"], registry=r)
        self.phase_seconds = Counter("dynaspec_phase_seconds", "generation time by phase",
                                     ["phase"], registry=r)
        self.batch_size = Histogram("dynaspec_batch_size", "requests whose plain steps or verifications ran in one "
                                    "pass of the target, per cycle", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
                                    registry=r)
        self.draft_limit = Histogram("dynaspec_draft_limit", "draft positions a request may draft in a cycle, as "
                                     "the batch's planner sets them (its stack's depth: no limit)",
                                     buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12), registry=r)
        self.tokens_per_second = Gauge("dynaspec_tokens_per_second", "tokens/s of the last finished request",
                                       registry=r)

    def record(self, stats: GenerationStats, prompt_tokens: int) -> None:
        """One finished (or cancelled) generation."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        for length in stats.accepted_lengths:
            self.accepted_length.observe(length)
        for p, (d, a) in enumerate(zip(stats.drafted_at, stats.accepted_at), start=1):
            self.drafted.labels(str(p)).inc(d)
            self.accepted.labels(str(p)).inc(a)
        for phase, keys in PHASES.items():
            self.phase_seconds.labels(phase).inc(sum(stats.times.get(k, 0.0) for k in keys))
        if stats.wall_time > 0:
            self.tokens_per_second.set(stats.tokens_per_second)
