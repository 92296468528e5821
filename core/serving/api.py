"""The OpenAI-compatible HTTP API of ``dynaspec serve``.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events in the chunk format the OpenAI clients parse), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text format).

Honoured parameters: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` (1 only),
``stream``, ``stream_options.include_usage`` and ``user``. Optional OpenAI parameters that would
change the output (penalties, ``logit_bias``, ``logprobs``, ``echo``, ``best_of``, tools, response
formats other than text) are accepted only at their neutral values and refused otherwise; a
parameter the OpenAI API does not have is refused. Errors use OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dynaspec.serving.metrics import Metrics
from dynaspec.serving.worker import Job, QueueFull, Worker

#: OpenAI parameters served as they are
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user"}
COMPLETION = COMMON | {"prompt"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
#: optional OpenAI parameters accepted at these neutral values only (anything else is refused)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False, None), "best_of": (1, None),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "audio": (None,),
}
ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A bad request: answered with status 400 (or ``status``) and OpenAI's error object."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, key: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (low < value if low_open else low <= value) and value <= high):
        bound = f"{'>' if low_open else '>='} {low} and <= {high}"
        raise RequestError(f"'{key}' must be a number {bound}, got {value!r}", param=key)
    return float(value)


class Server:
    """The engine, its worker thread, its metrics and the request checks the routes share."""

    def __init__(self, engine, *, api_key: str | None = None, max_queue: int = 16, threads: int = 0,
                 grace: float = 30.0, max_batch: int = 8) -> None:
        self.engine, self.api_key, self.grace = engine, api_key, grace
        self.metrics = Metrics()
        self.worker = Worker(engine, self.metrics, max_queue=max_queue, threads=threads, max_batch=max_batch)
        self.model_ids = {engine.stack.name, engine.target.name}
        self.ready = False
        self.stopping = False
        target = engine.target
        self.chat_template = bool(getattr(target.tokenizer, "chat_template", None))
        if self.chat_template:
            # a target mapped from its image loads the full tokenizer (the chat template's renderer)
            # on first use: here, before the port opens, not in the first request
            _ = target.tokenizer.apply_chat_template

    # -- checks ------------------------------------------------------------------------------------
    def check_params(self, body: Any, allowed: set[str]) -> None:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        for key, value in body.items():
            if key in allowed:
                continue
            if key in NEUTRAL:
                if value not in NEUTRAL[key]:
                    raise RequestError(f"'{key}' = {json.dumps(value)} is not supported by this server "
                                       f"(only {', '.join(json.dumps(v) for v in NEUTRAL[key])})", param=key)
                continue
            raise RequestError(f"unknown parameter '{key}'", param=key)
        model = body.get("model")
        if model not in self.model_ids:
            raise RequestError(f"the model '{model}' does not exist here: this server serves "
                               f"{' or '.join(sorted(self.model_ids))}", param="model", code="model_not_found")
        if body.get("n", 1) != 1:
            raise RequestError("'n' must be 1: this server returns one choice per request", param="n")

    def job(self, body: dict, prompt_ids: list[int], *, max_key: str = "max_tokens",
            default_stop: tuple[str, ...] = ()) -> Job:
        engine = self.engine
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        max_tokens = body.get(max_key, body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = engine.stack.decode.max_new_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"'{max_key}' must be an integer >= 1, got {max_tokens!r}", param=max_key)
        extra = engine.source.max_depth + 1 if engine.source is not None else 0
        context = engine.target.max_positions
        if len(prompt_ids) + max_tokens + extra > context:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) and {max_key} ({max_tokens}) exceed "
                               f"the model's context of {context} positions", param="prompt",
                               code="context_length_exceeded")
        temperature = _number(body, "temperature", engine.stack.decode.temperature, 0.0, 2.0)
        top_p = _number(body, "top_p", engine.stack.decode.top_p, 0.0, 1.0, low_open=True)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
            raise RequestError("'stream_options' takes only include_usage", param="stream_options")
        return Job(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                   seed=seed, stop=tuple(stops) or default_stop, loop=asyncio.get_running_loop())

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("the prompt is empty", param="prompt")
            return self.engine.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.target.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            return list(prompt)
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")

    def chat_prompt(self, body: dict) -> tuple[list[int], tuple[str, ...]]:
        """The token ids of a conversation in the target's chat template (or, for a target without
        one, its prompt format turn by turn), and the stop texts that end the assistant's turn."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", param="messages")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise RequestError(f"messages[{i}] needs a role among {', '.join(ROLES)}", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text parts only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise RequestError(f"messages[{i}]: only text content is supported", param="messages")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be text", param="messages")
            turns.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        if not any(t["content"].strip() for t in turns):
            raise RequestError("the messages are empty", param="messages")
        target = self.engine.target
        tok = target.tokenizer
        if self.chat_template:
            text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            bos = getattr(tok, "bos_token", None)
            if bos and text.startswith(bos):
                text = text[len(bos):]  # the tokenizer adds it itself
            return self.engine.encode(text), ()
        # a base model: its prompt format for each user turn; the next "User:" ends the answer
        parts = []
        for t in turns:
            if t["role"] == "user":
                parts.append(target.format_prompt(t["content"]))
            elif t["role"] == "assistant":
                parts.append(" " + t["content"] + "\n")
            else:
                parts.append(t["content"] + "\n")
        return self.engine.encode("".join(parts)), tuple(target.turn_stops)

    def extra(self, stats) -> dict[str, Any]:
        return {"stack": self.engine.stack.name, "mean_accepted_length": stats.mean_accepted_length,
                "cycles": stats.cycles, "tokens_per_second": stats.tokens_per_second,
                "exactness": stats.exactness}


def create_app(server: Server) -> FastAPI:
    """The FastAPI app for ``server`` (its worker starts with the app and stops with it)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        server.ready = True
        try:
            yield
        finally:
            server.stopping, server.ready = True, False
            await asyncio.get_running_loop().run_in_executor(None, server.worker.stop, server.grace)

    app = FastAPI(title="dynaspec", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        server.metrics.requests.labels(request.url.path, "error").inc()
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
                return JSONResponse(error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                               "authentication_error", code="invalid_api_key"), status_code=401)
        return await call_next(request)

    async def read_body(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None

    def submit(job: Job) -> None:
        if server.stopping:
            raise RequestError("the server is shutting down", status=503, kind="server_error")
        try:
            server.worker.submit(job)
        except QueueFull:
            raise RequestError("the server is busy: its queue is full, retry later", status=503,
                               kind="server_error") from None

    def busy_response(exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind), status_code=503, headers={"Retry-After": "1"})

    async def run(request: Request, body: dict, job: Job, *, chat: bool):
        try:
            submit(job)
        except RequestError as exc:
            if exc.status == 503:
                server.metrics.requests.labels(request.url.path, "busy").inc()
                return busy_response(exc)
            raise
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created, model = int(job.created), body["model"]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream_events(request, job, ident, created, model, chat, include_usage),
                                     media_type="text/event-stream")
        text = []
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    server.metrics.requests.labels(request.url.path, "cancelled").inc()
                    return JSONResponse({}, status_code=499)
                continue
            if kind == "text":
                text.append(value)
            elif kind == "error":
                server.metrics.requests.labels(request.url.path, "failed").inc()
                return JSONResponse(error_body(value, "server_error"), status_code=500)
            else:
                stats = value
                break
        server.metrics.requests.labels(request.url.path, "ok").inc()
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                   "finish_reason": stats.finish_reason} if chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": stats.finish_reason})
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage(job, stats), "dynaspec": server.extra(stats)}

    def usage(job: Job, stats) -> dict[str, int]:
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": stats.new_tokens,
                "total_tokens": len(job.prompt_ids) + stats.new_tokens}

    async def stream_events(request: Request, job: Job, ident, created, model, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, *, first: bool = False) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta = {"role": "assistant", **delta}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            body = {"id": ident, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk("", None, first=True)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield chunk(value, None)
                elif kind == "error":
                    server.metrics.requests.labels(request.url.path, "failed").inc()
                    yield f"data: {json.dumps(error_body(value, 'server_error'))}\n\n"
                    finished = True
                    return
                else:
                    stats = value
                    yield chunk(None, stats.finish_reason)
                    if include_usage:
                        yield (f"data: {json.dumps({'id': ident, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': usage(job, stats), 'dynaspec': server.extra(stats)})}\n\n")
                    yield "data: [DONE]\n\n"
                    server.metrics.requests.labels(request.url.path, "ok").inc()
                    finished = True
                    return
        finally:
            if not finished:  # the client went away: free the engine at its next cycle
                job.cancel()
                server.metrics.requests.labels(request.url.path, "cancelled").inc()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        server.check_params(body, COMPLETION)
        job = server.job(body, server.completion_prompt(body))
        return await run(request, body, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        server.check_params(body, CHAT)
        ids, stops = server.chat_prompt(body)
        job = server.job(body, ids, max_key="max_completion_tokens" if "max_completion_tokens" in body
                         else "max_tokens", default_stop=stops)
        return await run(request, body, job, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dynaspec"}
                                           for name in sorted(server.model_ids)]}

    @app.get("/health")
    async def health():
        status = 200 if server.ready and not server.stopping else 503
        return JSONResponse({"status": "ready" if status == 200 else "stopping", "stack": server.engine.stack.name,
                             "queued": server.worker.jobs.qsize(), "running": len(server.worker.running)},
                            status_code=status)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
