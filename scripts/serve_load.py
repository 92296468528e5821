"""Load a running `dynaspec serve` the way an application does, and compare configurations.

For each configuration STACK:MAX_BATCH, a server is started (`dynaspec serve --stack STACK
--max-batch MAX_BATCH`, one torch thread) and answers one untimed request, and for each number of
concurrent clients, that many client threads take dev prompts (in the target's prompt format,
through /v1/completions, greedy, streamed) from a shared list until it is empty. Reported per configuration and concurrency:
aggregate tokens/s (completion tokens of all requests / wall time from the first request to the
last answer), the median time to the first streamed text, and whether every answer equals the
same prompt's answer in the first configuration (greedy output is the target's whatever the stack
and the batch). With --solo, the same prompts go through `Engine.generate` in this process first,
one at a time: the tokens/s a served request at concurrency 1 is compared with.

    python scripts/serve_load.py --configs default:8 default:1 qwen-baseline:8 --clients 1 4 16 \\
        --prompts 16 --new-tokens 64 --solo default --json-out serve-load.json

Needs the serve extra and the `openai` client (pip install -e ".[serve,test]").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(stack: str, max_batch: int, threads: int, queue: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dynaspec", "serve", "--stack", stack, "--port", str(port),
                             "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue", str(queue)],
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server for {stack} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server for {stack} did not become ready")


def _client(url: str):
    """An OpenAI client of the server at ``url``: no retries, no timeout that a long answer meets."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)


def load(url: str, model: str, prompts: list[str], clients: int, new_tokens: int) -> dict:
    """``clients`` threads answer ``prompts`` (streamed, greedy); per request its text, completion
    tokens, time to first text and total time; overall the aggregate tokens/s."""
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    rows: dict[int, dict] = {}
    errors: list[str] = []

    def client() -> None:
        api = _client(url)
        while True:
            with lock:
                if not todo:
                    return
                index, prompt = todo.pop(0)
            try:
                sent = time.perf_counter()
                first, text, usage = None, [], None
                stream = api.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        first = first or time.perf_counter()
                        text.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        usage = chunk.usage
                done = time.perf_counter()
                rows[index] = {"text": "".join(text), "tokens": usage.completion_tokens if usage else None,
                               "ttft": (first or done) - sent, "seconds": done - sent}
            except Exception as exc:  # noqa: BLE001 - reported, and the run fails below
                errors.append(f"prompt {index}: {exc!r}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise SystemExit("requests failed: " + "; ".join(errors[:5]))
    ordered = [rows[i] for i in range(len(prompts))]
    tokens = sum(r["tokens"] for r in ordered)
    return {"clients": clients, "requests": len(ordered), "tokens": tokens, "wall_s": round(wall, 3),
            "aggregate_tokens_per_s": round(tokens / wall, 2),
            "median_ttft_s": round(statistics.median(r["ttft"] for r in ordered), 3),
            "median_request_tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in ordered), 2),
            "rows": ordered}


def warm_up(url: str, model: str, prompt: str, new_tokens: int) -> None:
    """One untimed request before the timed ones: a new server's first passes fault its mapped
    weights in (from disk where the page cache lost them), so whichever configuration ran first
    measured slower (session 39: the same stack 0.72x and 0.89x of plain decoding when first, 1.05x
    when second)."""
    api = _client(url)
    api.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0)


def histogram_totals(url: str) -> dict[str, tuple[float, float]]:
    """``{name: (sum, count)}`` of the server's histograms now (``/metrics``)."""
    import httpx

    out: dict[str, list[float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for suffix, slot in (("_sum ", 0), ("_count ", 1)):
            if line.startswith("dynaspec_") and suffix in line:
                name = line.split(suffix)[0]
                out.setdefault(name, [0.0, 0.0])[slot] = float(line.split()[-1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def mean_between(before: dict, after: dict, name: str) -> float | None:
    """The mean of histogram ``name`` over what it observed between two readings."""
    s0, c0 = before.get(name, (0.0, 0.0))
    s1, c1 = after.get(name, (0.0, 0.0))
    return round((s1 - s0) / (c1 - c0), 3) if c1 > c0 else None


def solo(stack: str, prompts: list[str], new_tokens: int) -> dict:
    from dynaspec.runtime.engine import Engine

    engine = Engine.from_stack(stack)
    rates, texts = [], []
    for p in prompts:
        result = engine.generate(p, max_new_tokens=new_tokens)
        rates.append(result.stats.new_tokens / result.stats.wall_time)
        texts.append(result.text)
    return {"stack": stack, "median_tokens_per_s": round(statistics.median(rates), 2), "texts": texts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", required=True, metavar="STACK:MAX_BATCH",
                    help="server configurations; the first one's answers are the reference")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=16, help="dev prompts (the same ones at every concurrency)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--solo", metavar="STACK", help="also time Engine.generate alone on the same prompts")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from dynaspec.runtime.stacks import resolve_stack
    from dynaspec.runtime.targets import load_target
    from dynaspec.training.data import dev_protocol_prompts

    first_stack = args.configs[0].split(":")[0]
    target = load_target(resolve_stack(first_stack).target)
    prompts = [target.format_prompt(p["text"]) for p in dev_protocol_prompts(args.prompts)]
    del target
    report: dict = {"prompts": len(prompts), "new_tokens": args.new_tokens, "threads": args.threads, "runs": []}
    if args.solo:
        report["solo"] = solo(args.solo, prompts, args.new_tokens)
        print(f"solo {args.solo}: {report['solo']['median_tokens_per_s']} tokens/s (median over prompts)",
              file=sys.stderr)
    reference: list[str] | None = None
    for config in args.configs:
        stack, _, batch = config.rpartition(":")
        if not batch.isdigit():
            stack, batch = config, ""
        max_batch = int(batch or 8)
        proc, url = start_server(stack, max_batch, args.threads, queue=max(args.clients) + 1)
        try:
            import httpx

            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]  # the stack's name
            warm_up(url, model, prompts[0], args.new_tokens)
            for clients in args.clients:
                before = histogram_totals(url)
                run = load(url, model, prompts, clients, args.new_tokens)
                after = histogram_totals(url)
                # requests per pass of the target, and the draft positions the planner allowed
                run["mean_batch"] = mean_between(before, after, "dynaspec_batch_size")
                run["mean_draft_limit"] = mean_between(before, after, "dynaspec_draft_limit")
                texts = [r["text"] for r in run["rows"]]
                reference = reference or texts
                run.update(stack=model, stack_ref=stack, max_batch=max_batch,
                           identical=sum(a == b for a, b in zip(texts, reference)))
                if args.solo:
                    run["identical_to_solo"] = sum(a == b for a, b in zip(texts, report["solo"]["texts"]))
                report["runs"].append(run)
                print(f"{stack} max-batch {max_batch}, {clients} clients: {run['aggregate_tokens_per_s']} tokens/s "
                      f"aggregate, TTFT {run['median_ttft_s']} s, {run['identical']}/{len(texts)} identical",
                      file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    lines = ["| stack | max batch | clients | aggregate tokens/s | median time to first text | median tokens/s per "
             "request | mean requests per pass | mean draft limit | answers identical to the first configuration's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['stack']} | {r['max_batch']} | {r['clients']} | {r['aggregate_tokens_per_s']:.2f} | "
                     f"{r['median_ttft_s']:.2f} s | {r['median_request_tokens_per_s']:.2f} | "
                     f"{r['mean_batch'] or ''} | {r['mean_draft_limit'] if r['mean_draft_limit'] is not None else ''} | "
                     f"{r['identical']}/{r['requests']} |")
    print("\n".join(lines))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
