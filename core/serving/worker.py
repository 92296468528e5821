"""The engine's thread: requests wait in a bounded queue and are generated one at a time.

The HTTP side (an asyncio event loop) puts a :class:`Job` in the queue and reads its events: text
pieces as they are generated, then the end (finish reason and statistics) or an error. The engine
runs on one worker thread, so the loop keeps answering (health, metrics, new requests) while it
generates. A job whose client went away is cancelled: the worker stops it at the next cycle. An
exception inside the engine fails that job alone.

Requests are generated one after another; verifying several requests' drafts in one pass of the
target (continuous batching) is not built yet.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Sequence

import attrs

from dynaspec.runtime.stats import GenerationStats


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


class Worker:
    """The thread that owns the engine."""

    def __init__(self, engine, metrics, *, max_queue: int, threads: int = 0) -> None:
        self.engine, self.metrics, self.threads = engine, metrics, threads
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running: Job | None = None
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
        """Take no more jobs; let the running one finish for ``grace`` seconds, then cancel it, and
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
        if self.running is not None:
            self.running.cancel()
        self._thread.join(5.0)

    def _run(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        while True:
            job = self.jobs.get()
            self.metrics.queued.set(self.jobs.qsize())
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.running = job
            self.metrics.running.set(1)
            self.metrics.batch_size.set(1)
            try:
                self._generate(job)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
                job.emit("error", f"{type(exc).__name__}: {exc}")
            finally:
                self.running = None
                self.metrics.running.set(0)
                self.metrics.record(job.stats, len(job.prompt_ids))

    def _generate(self, job: Job) -> None:
        stats, start = job.stats, time.perf_counter()
        pieces = self.engine.stream(job.prompt_ids, stats=stats, stop=job.stop, max_new_tokens=job.max_tokens,
                                    temperature=job.temperature, top_p=job.top_p, seed=job.seed)
        for piece in pieces:
            if job.cancelled.is_set():
                pieces.close()
                stats.wall_time = time.perf_counter() - start
                return
            job.emit("text", piece)
        stats.wall_time = time.perf_counter() - start
        job.emit("done", stats)
