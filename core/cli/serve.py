"""``dynaspec serve``: an OpenAI-compatible server (the ``serve`` extra)."""

from __future__ import annotations

import argparse
import signal
import sys

from dynaspec.cli.common import command, overrides, positive_int
from dynaspec.errors import InputError


def served_stack(stack, max_batch: int):
    """The stack as a server with batches of up to ``max_batch`` requests runs it: a stack whose
    draft is ``"auto"`` drafts its chain when requests can share a pass, since a tree's extra rows
    are then rows of other requests (served, 4 clients: the tree 52-58 tokens/s, the chain 58-62;
    docs/history.md, session 31)."""
    import attrs

    if stack.draft.mode == "auto" and max_batch > 1:
        return attrs.evolve(stack, draft=stack.draft.as_chain())
    return stack


def register(sub) -> None:
    srv = command(sub, cmd_serve, "serve", placement=True,
                  help="serve a stack over an OpenAI-compatible HTTP API")
    srv.add_argument("--stack", default="default", help="stack name or TOML file (default: %(default)s)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    srv.add_argument("--port", type=positive_int, default=8000, help="port (default: %(default)s)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/ routes (default: no key)")
    srv.add_argument("--max-queue", type=positive_int, default=16, metavar="N",
                     help="requests that may wait for the engine; beyond, 503 with Retry-After (default: %(default)s)")
    srv.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                     help="requests generated together, their plain steps and verifications in one pass of "
                     "the target; more wait in the queue. With several, each drafts as deep as the measured cost "
                     "of a cycle's rows and its acceptance so far make pay, down to plain steps, and a stack "
                     "with draft.mode = \"auto\" drafts its chain, not its tree "
                     "(default: %(default)s; 1: one request at a time)")
    srv.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, how long running requests may finish before they are cancelled "
                     "(default: %(default)s)")
    srv.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a stack field")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a stack over an OpenAI-compatible HTTP API: POST /v1/completions and
    /v1/chat/completions (streaming with "stream": true), GET /v1/models, /health and /metrics
    (Prometheus). The model loads before the port opens; SIGTERM stops taking requests, lets the
    running ones finish within --grace seconds, and exits 0. Up to --max-batch requests are
    generated together: each cycle their plain steps and verifications go through the target in
    one pass, and each request's output is what it gives alone.
    Needs the serve extra: pip install "dynaspec[serve]"."""
    try:
        import uvicorn

        from dynaspec.serving.api import Server, create_app
    except ImportError as exc:
        raise InputError(f"dynaspec serve needs the serve extra ({exc.name} is missing): "
                         "pip install -e \".[serve]\"") from None
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.registry import default_registry
    from dynaspec.runtime.stacks import resolve_stack

    if args.grace < 0:
        raise InputError(f"--grace must be >= 0, got {args.grace}")
    registry = default_registry()
    stack = served_stack(resolve_stack(args.stack, overrides=overrides(args), registry=registry), args.max_batch)
    registry.check_stack(stack)
    engine = Engine.from_stack(stack, registry=registry)
    if engine.target.tokenizer is None:
        raise InputError(f"target '{engine.target.name}' has no tokenizer: it cannot be served over text")
    server = Server(engine, api_key=args.api_key, max_queue=args.max_queue, threads=args.threads, grace=args.grace,
                    max_batch=args.max_batch)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=max(1, int(args.grace)))
    runner = uvicorn.Server(config)
    print(f"dynaspec serve: stack {stack.name} on target {engine.target.name}; listening on "
          f"http://{args.host}:{args.port} (exactness {engine.exactness})", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler that
    # was there before it: a no-op one, so that a graceful stop exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    runner.run()
    return 0
