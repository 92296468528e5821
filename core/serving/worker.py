"""The engine's thread: requests wait in a bounded queue and are generated together, verified
in shared passes of the target (continuous batching).

The HTTP side (an asyncio event loop) puts a :class:`Job` in the queue and reads its events: text
pieces as they are generated, then the end (finish reason and statistics) or an error. The engine
runs on one worker thread, so the loop keeps answering (health, metrics, new requests) while it
generates.

Each cycle, every active request drafts on its own (its own caches, drafter state, shortlists and
random generator) up to its next plain step or verification, and all those passes go through the
target together (:meth:`TargetModel.forward_many`: the products once over all the rows, each
request attending over its own cache). The target's kernels compute every row as they would alone,
so each request's output is what it gives alone. New requests join between cycles (their prefill
runs when they join) and finished ones leave. A job whose client went away is cancelled: it leaves
at the next cycle. An exception inside the engine fails that job alone.

With several requests in a batch, a :class:`~dynaspec.serving.planner.DepthPlanner` sets how deep
each drafts this cycle, from the measured cycle costs and each request's acceptance, so that
drafting never costs the batch more than it gains.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Iterator, Sequence

import attrs

from dynaspec.runtime.gate import DepthControl
from dynaspec.runtime.stats import GenerationStats
from dynaspec.runtime.target import TargetPass
from dynaspec.serving.planner import DepthPlanner


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


@attrs.define(eq=False)
class Job:
    """One request: its prompt (token ids), its decoding parameters and its event channel."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: Sequence[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = attrs.field(factory=asyncio.Queue)
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    stats: GenerationStats = attrs.field(factory=GenerationStats)
    created: float = attrs.field(factory=time.time)

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the event loop (from the worker thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


@attrs.define(eq=False)
class _Active:
    """A job being generated: its generation's items (text pieces and target passes) and its start."""

    job: Job
    items: Iterator
    control: DepthControl
    started: float = attrs.field(factory=time.perf_counter)
    #: its prefill has not run yet (it runs at its first advance)
    fresh: bool = True


class Worker:
    """The thread that owns the engine."""

    def __init__(self, engine, metrics, *, max_queue: int, threads: int = 0, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.metrics, self.threads, self.max_batch = engine, metrics, threads, max_batch
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        source = engine.source
        #: the draft depths of a batch (None: the stack does not draft)
        self.planner = DepthPlanner(source.max_depth) if source is not None else None
        #: the jobs being generated now
        self.running: list[Job] = []
        self._thread = threading.Thread(target=self._run, name="dynaspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        self.metrics.queued.set(self.jobs.qsize())

    def stop(self, grace: float) -> None:
        """Take no more jobs; let the running ones finish for ``grace`` seconds, then cancel them, and
        cancel every job still waiting."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit("error", "the server is shutting down")
        self.jobs.put(None)
        self._thread.join(grace)
        for job in list(self.running):
            job.cancel()
        self._thread.join(5.0)

    def _run(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        active: list[_Active] = []
        closing = False
        while True:
            while not closing and len(active) < self.max_batch:  # new jobs join between cycles
                try:
                    job = self.jobs.get(block=not active)
                except queue.Empty:
                    break
                self.metrics.queued.set(self.jobs.qsize())
                if job is None:
                    closing = True
                elif not job.cancelled.is_set():
                    try:
                        active.append(self._begin(job))
                    except Exception as exc:  # noqa: BLE001 - a request that cannot start fails alone
                        job.emit("error", f"{type(exc).__name__}: {exc}")
                        self.metrics.record(job.stats, len(job.prompt_ids))
            if not active:
                if closing:
                    return
                continue
            self.running = [a.job for a in active]
            self.metrics.running.set(len(active))
            if self.planner is not None:
                for limit in self.planner.plan([a.control for a in active]):
                    self.metrics.draft_limit.observe(self.planner.max_depth if limit is None else limit)
            cycle = time.perf_counter()
            joined = any(a.fresh for a in active)
            passes = []
            for entry in list(active):
                step = self._advance(entry)
                entry.fresh = False
                if step is None:
                    active.remove(entry)
                    if self.planner is not None:
                        self.planner.retire(entry.control)
                else:
                    passes.append(step)
            if passes:
                self.metrics.batch_size.observe(len(passes))
                started = time.perf_counter()
                try:
                    self.engine.target.forward_many(passes, strict=self.engine.strict)
                except Exception as exc:  # noqa: BLE001 - it reaches the requests, not the server
                    for step in passes:
                        step.error = step.error or exc
                seconds = time.perf_counter() - started
                for step in passes:
                    step.seconds = seconds
                if self.planner is not None and not joined:
                    drafted = sum(len(step.ids) - 1 for step in passes)
                    self.planner.costs.observe(len(passes), drafted, time.perf_counter() - cycle)
            if not active:
                self.running = []
                self.metrics.running.set(0)

    def _begin(self, job: Job) -> _Active:
        control = DepthControl()
        items = self.engine.stream_passes(job.prompt_ids, stats=job.stats, stop=job.stop, control=control,
                                          max_new_tokens=job.max_tokens, temperature=job.temperature,
                                          top_p=job.top_p, seed=job.seed)
        return _Active(job, items, control)

    def _advance(self, entry: _Active):
        """Run ``entry``'s generation to its next target pass (None: it has left: finished, failed
        or cancelled), handing its text to its client."""
        job, stats = entry.job, entry.job.stats
        try:
            if job.cancelled.is_set():
                entry.items.close()
                stats.wall_time = time.perf_counter() - entry.started
                self.metrics.record(stats, len(job.prompt_ids))
                return None
            for item in entry.items:
                if isinstance(item, TargetPass):
                    return item
                job.emit("text", item)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
            job.emit("error", f"{type(exc).__name__}: {exc}")
            self.metrics.record(stats, len(job.prompt_ids))
            return None
        stats.wall_time = time.perf_counter() - entry.started
        job.emit("done", stats)
        self.metrics.record(stats, len(job.prompt_ids))
        return None
