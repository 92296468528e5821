"""The server's engine thread under load, without HTTP: where a batch's time goes.

Every request (train prompts from --first on, in the target's prompt format, greedy) is queued at
once into a :class:`dynaspec.serving.worker.Worker` with the given max batch; the stacks run one
after the other, alternating for ``--rounds``. Per run: aggregate tokens/s, the target's passes
(count, seconds, requests' rows and all rows), the prefills' seconds and the rest of the engine
thread. ``--hold`` makes the batch planner grant no draft positions (probes and a request alone
still draft), to see what speculation costs a batch that does not draft. ``--pass-rows`` caps a
pass's rows below what the probe covered, to see what one pass for a whole batch is worth.

    python scripts/serve_engine_load.py --stacks default qwen-baseline --requests 16 --max-batch 8
"""

from __future__ import annotations

import argparse
import itertools
import time


class _Loop:
    """The event loop a job reports to: errors are printed, text is dropped."""

    def call_soon_threadsafe(self, fn, *args) -> None:
        if args and args[0][0] == "error":
            print("error:", args[0][1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", nargs="+", default=["default", "qwen-baseline"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--first", type=int, default=10000, help="the first train prompt (10,000: never trained on)")
    parser.add_argument("--dev", action="store_true",
                        help="the first --requests dev prompts instead (serve_load.py's: to compare with a served run)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hold", action="store_true", help="the batch planner grants no draft positions")
    parser.add_argument("--pass-rows", type=int, default=None,
                        help="cap one pass of the target (and one shared head product) at this many rows, below "
                             "what the numerics probe covered (16: the probe's reach before session 42); a larger "
                             "batch's rows run in several passes")
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.engine import Engine
    from dynaspec.serving import planner
    from dynaspec.serving.metrics import Metrics
    from dynaspec.serving.worker import Job, Worker
    from dynaspec.training import data

    torch.set_num_threads(args.threads)
    if args.hold:
        planner.grant = lambda rates, base, per_row: [0] * rates.shape[0]
    engines = dict(zip(args.stacks, Engine.from_stacks(args.stacks)))
    if args.pass_rows is not None:
        for engine in engines.values():
            target = engine.target
            if not 1 <= args.pass_rows <= target.max_pass_rows:
                parser.error(f"--pass-rows must be 1 to {target.max_pass_rows} (the rows the probe covered)")
            target.max_pass_rows = args.pass_rows
            target.max_head_rows = min(target.max_head_rows, args.pass_rows)
    if args.dev:
        texts = [p["text"] for p in data.dev_protocol_prompts(args.requests)]
    else:
        texts = [p["text"] for p in itertools.islice(data.training_prompts(), args.first, args.first + args.requests)]

    def run(name: str) -> None:
        engine = engines[name]
        target = engine.target
        seen = {"passes": 0, "seconds": 0.0, "requests": 0, "rows": 0}
        forward_many = target.forward_many

        def counted(passes, **kwargs):
            start = time.perf_counter()
            forward_many(passes, **kwargs)
            seen["seconds"] += time.perf_counter() - start
            seen["passes"] += 1
            seen["requests"] += len(passes)
            seen["rows"] += sum(len(p.ids) for p in passes)

        target.forward_many = counted
        try:
            metrics = Metrics()
            worker = Worker(engine, metrics, max_queue=args.requests + 1, max_batch=args.max_batch)
            jobs = [Job(prompt_ids=list(engine.encode(target.format_prompt(t))), max_tokens=args.new_tokens,
                        temperature=0.0, top_p=1.0, seed=None, stop=(), loop=_Loop()) for t in texts]
            worker.start()
            start = time.perf_counter()
            for job in jobs:
                worker.submit(job)
            worker.jobs.put(None)  # stop once every job is done
            worker._thread.join()
            wall = time.perf_counter() - start
        finally:
            del target.forward_many
        tokens = sum(j.stats.new_tokens for j in jobs)
        prefill = sum(j.stats.times.get("prefill", 0.0) for j in jobs)
        print(f"{name}: {tokens / wall:.2f} tokens/s ({tokens} in {wall:.2f} s); passes {seen['passes']} "
              f"({seen['seconds']:.2f} s, {seen['requests']} requests' rows, {seen['rows']} rows); prefills "
              f"{prefill:.2f} s; the rest {wall - seen['seconds'] - prefill:.2f} s", flush=True)

    for _ in range(args.rounds):
        for name in args.stacks:
            run(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
