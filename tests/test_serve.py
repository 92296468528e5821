"""``dynaspec serve`` as a user runs it: a real server in a subprocess on the tiny target, spoken
to with the official ``openai`` client and with raw HTTP. Streamed text joined equals the
non-streamed text, which equals the engine's own generation; every error has its status and
OpenAI's error object; clients that go away free the engine; SIGTERM exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import trained_drafter  # noqa: E402

KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(stack, *extra) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynaspec", "serve", "--stack", str(stack), "--port", str(port),
                             "--threads", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read().decode()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def stack_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    trained_drafter("llama").save(root / "drafter")
    path = root / "spec.toml"
    path.write_text(f'name = "spec"\ntarget = "tiny-llama"\ndrafter = "{root / "drafter"}"\n'
                    '[draft]\nmode = "chain"\ndepth = 3\n[decode]\nmax_new_tokens = 24\n')
    return path


@pytest.fixture(scope="module")
def server(stack_file):
    proc, url = _start(stack_file, "--api-key", KEY, "--max-queue", "2", "--max-batch", "4")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def engine(stack_file):
    from dynaspec.runtime.engine import Engine

    return Engine.from_stack(str(stack_file))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_completion_streamed_and_not_equal_the_engine(client, engine):
    prompt = "The cat sat on"
    solo = engine.generate(prompt, max_new_tokens=20)
    out = client.completions.create(model="spec", prompt=prompt, max_tokens=20)
    assert out.choices[0].text == solo.text
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(solo.prompt_ids) and out.usage.completion_tokens == len(solo.token_ids)
    assert out.model_extra["dynaspec"]["stack"] == "spec"
    assert out.model_extra["dynaspec"]["mean_accepted_length"] >= 1.0
    pieces = list(client.completions.create(model="spec", prompt=prompt, max_tokens=20, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == solo.text
    assert pieces[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_chat_streamed_and_not_equal_the_engine(client, engine):
    # the tiny target has no chat template: its prompt format, and the next "User:" ends the answer
    message = "Say something."
    solo = engine.generate(engine.target.format_prompt(message), max_new_tokens=24, stop=["\nUser:"])
    out = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": message}],
                                         max_tokens=24)
    assert out.choices[0].message.content == solo.text and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": message}],
                                            max_tokens=24, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solo.text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_sampling_with_a_seed_is_reproducible(client, engine):
    a = client.completions.create(model="spec", prompt="Once", max_tokens=16, temperature=0.8, seed=3)
    b = client.completions.create(model="spec", prompt="Once", max_tokens=16, temperature=0.8, seed=3, top_p=0.9)
    c = client.completions.create(model="spec", prompt="Once", max_tokens=16, temperature=0.8, seed=3)
    assert a.choices[0].text == c.choices[0].text == engine.generate("Once", max_new_tokens=16, temperature=0.8,
                                                                      seed=3).text
    assert b.usage.completion_tokens >= 1


def test_stop_texts_cut_the_answer(client, engine):
    solo = engine.generate("The cat sat on", max_new_tokens=20).text
    stop = solo[5:7]
    out = client.completions.create(model="spec", prompt="The cat sat on", max_tokens=20, stop=[stop])
    assert out.choices[0].text == solo[:solo.find(stop)] and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"model": "nope", "prompt": "x"}, "model"),
    ({"model": "spec", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "spec", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "spec", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "spec", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "spec", "prompt": "   "}, "prompt"),
    ({"model": "spec", "prompt": "x" * 2100}, "prompt"),
    ({"model": "spec", "prompt": "x", "n": 2}, "n"),
    ({"model": "spec", "prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"model": "spec", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "spec", "prompt": "x", "stop": ""}, "stop"),
])
def test_bad_requests_get_400_and_an_openai_error(server, body, param):
    r = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_neutral_optional_parameters_are_accepted(client):
    out = client.completions.create(model="spec", prompt="Hi", max_tokens=4, presence_penalty=0,
                                    frequency_penalty=0.0, user="u1")
    assert out.usage.completion_tokens == 4 or out.choices[0].finish_reason == "stop"


def test_invalid_json_empty_messages_and_missing_key(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": "spec", "messages": []}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server + "/v1/completions", json={"model": "spec", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/health").json()["status"] == "ready"  # health needs no key
    models = httpx.get(server + "/v1/models", headers=auth).json()
    assert {m["id"] for m in models["data"]} == {"spec", "tiny-llama"}


def test_concurrent_clients_get_their_solo_outputs_and_disconnects_free_the_engine(server, engine):
    """16 clients at once, mixed lengths, some streaming, two going away mid-stream: up to 4 are
    generated together (--max-batch 4) and every answer is the engine's answer to it alone."""
    n = 16
    prompts = [f"Request {i}: " + "abc" * (i % 4) for i in range(n)]
    lengths = [8 + 4 * (i % 3) for i in range(n)]
    solo = [engine.generate(p, max_new_tokens=n).text for p, n in zip(prompts, lengths)]
    results, errors = {}, []
    # a queue of 2 behind the 4 running requests: clients retry on 503, as OpenAI clients do
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=20)

    def ask(i):
        try:
            if i in (2, 5):  # these two go away mid-stream
                stream = client.completions.create(model="spec", prompt=prompts[i], max_tokens=200, stream=True)
                next(iter(stream))
                stream.close()
                results[i] = None
            elif i % 2:
                chunks = client.completions.create(model="spec", prompt=prompts[i], max_tokens=lengths[i],
                                                   stream=True)
                results[i] = "".join(c.choices[0].text for c in chunks)
            else:
                results[i] = client.completions.create(model="spec", prompt=prompts[i],
                                                       max_tokens=lengths[i]).choices[0].text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i in range(n):
        if i not in (2, 5):
            assert results[i] == solo[i], i
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ready"
    deadline = time.time() + 30
    while httpx.get(server + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.2)  # the disconnected streams are cancelled at their next cycle
    assert httpx.get(server + "/health").json() == {**health, "running": 0, "queued": 0}
    metrics = httpx.get(server + "/metrics").text
    assert 'dynaspec_requests_total{outcome="cancelled",route="/v1/completions"}' in metrics
    assert "dynaspec_accepted_length_bucket" in metrics and 'dynaspec_drafted_tokens_total{position="1"}' in metrics
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("dynaspec_batch_size")}
    # requests really were verified together: not every cycle's pass held one request
    assert values['dynaspec_batch_size_bucket{le="1.0"}'] < values["dynaspec_batch_size_count"]


def test_a_full_queue_answers_503_with_retry_after(server):
    codes, headers = [], []
    auth = {"Authorization": f"Bearer {KEY}"}

    def ask():
        r = httpx.post(server + "/v1/completions", json={"model": "spec", "prompt": "Busy", "max_tokens": 400},
                       headers=auth, timeout=120)
        codes.append(r.status_code)
        headers.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=ask) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes.count(200) >= 3 and 503 in codes  # four running, two queued, the rest turned away
    assert all(h == "1" for c, h in zip(codes, headers) if c == 503)


def test_sigterm_finishes_and_exits_zero(stack_file):
    proc, url = _start(stack_file)
    box = {}

    def ask():
        box["r"] = httpx.post(url + "/v1/completions", json={"model": "spec", "prompt": "Long", "max_tokens": 300},
                              timeout=120)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    t.join(30)
    assert box["r"].status_code == 200 and json.loads(box["r"].text)["usage"]["completion_tokens"] >= 1


def test_a_request_that_fails_inside_the_engine_fails_alone(engine):
    """The app in-process around the real engine, whose generation raises for one prompt: that
    request gets a 500 with an error object, and the next one is answered."""
    from fastapi.testclient import TestClient

    from dynaspec.serving.api import Server, create_app

    real_stream = engine.stream_passes

    def stream(prompt_ids, **kwargs):
        if engine.decode(prompt_ids).startswith("boom"):
            raise RuntimeError("the engine broke")
        return real_stream(prompt_ids, **kwargs)

    server = Server(engine, max_queue=2)
    server.engine = type("Wrapped", (), {})()  # the same engine, with a stream that can fail
    for name in ("stack", "target", "source", "encode", "decode", "exactness", "strict"):
        setattr(server.engine, name, getattr(engine, name))
    server.engine.stream_passes = stream
    server.worker.engine = server.engine
    with TestClient(create_app(server)) as http:
        bad = http.post("/v1/completions", json={"model": "spec", "prompt": "boom", "max_tokens": 4})
        assert bad.status_code == 500 and "the engine broke" in bad.json()["error"]["message"]
        good = http.post("/v1/completions", json={"model": "spec", "prompt": "fine", "max_tokens": 4})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == engine.generate(
            "fine", max_new_tokens=4).text
        assert http.get("/health").json()["status"] == "ready"


@pytest.mark.slow
def test_the_real_default_served_equals_generate_alone_and_batched():
    """``dynaspec serve`` on the embedded default (Qwen2.5-Coder, chat template): streamed and
    non-streamed answers, alone and three at once, each equal to ``Engine.generate`` for it."""
    from dynaspec.runtime.engine import Engine

    engine = Engine.from_stack("default")
    proc, url = _start("default", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        message = "Write a Python function that reverses a string."
        text = engine.target.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                           add_generation_prompt=True)
        solo = engine.generate(text, max_new_tokens=40)
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": message}],
                                             max_tokens=40)
        assert out.choices[0].message.content == solo.text
        assert out.usage.completion_tokens == len(solo.token_ids)
        stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": message}],
                                                max_tokens=40, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == solo.text
        prompts = [engine.target.format_prompt(p) for p in ("What is a monad?", "Sort a list in Go.",
                                                            "Explain TCP slow start.")]
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            answers[i] = client.completions.create(model="default", prompt=prompts[i], max_tokens=32).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [answers[i] for i in range(len(prompts))] == [engine.generate(p, max_new_tokens=32).text
                                                             for p in prompts]
        metrics = httpx.get(url + "/metrics").text
        assert "dynaspec_batch_size_bucket" in metrics and "dynaspec_draft_limit_count" in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0


def test_a_server_with_batches_drafts_an_auto_stacks_chain():
    # draft.mode = "auto": a tree only where rows are cheap and alone; a server that batches keeps
    # the chain (a tree's extra rows are other requests' rows there)
    from dynaspec.cli.serve import served_stack
    from dynaspec.runtime.stacks import resolve_stack

    stack = resolve_stack("default")
    assert stack.draft.mode == "auto"
    batched = served_stack(stack, 8)
    assert (batched.draft.mode, batched.draft.topk, batched.draft.total_tokens) == ("chain", 1, stack.draft.depth)
    assert served_stack(stack, 1) is stack
    chain = resolve_stack("default-trained")
    assert served_stack(chain, 8) is chain
