"""Work for nobody stops and the queue is bounded (verifier/api/lifecycle.py), through a real uvicorn
server on 127.0.0.1 over the real SmolLM2: clients that send a request and leave (raw sockets, so
that "leaving" is a closed connection as a real client's) have their samples aborted, waiting ones
without a prefill; beyond --max-waiting / --max-waiting-tokens new requests get 429."""

import contextlib
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from engine_fixtures import engine

from verifier.api import create_app
from verifier.api.lifecycle import LifecycleConfig
from verifier.engine.runner import EngineLoop

LONG = 600  # output tokens no test waits for (the engine's max_len is 640)
PROMPT = "def fibonacci(n):"


@contextlib.contextmanager
def serve(lm, lifecycle: LifecycleConfig = LifecycleConfig(), max_batch: int = 1):
    """A real server over a plain-decoding engine of ``max_batch`` slots; yields (client, port, app)."""
    loop = EngineLoop(engine(lm, None, max_batch=max_batch)).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(loop, "smollm2", lifecycle=lifecycle)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client, port, app
    finally:
        loop.abort_all()
        server.should_exit = True
        thread.join(10)
        loop.stop()


def send(port: int, body: dict, route: str = "/v1/completions") -> socket.socket:
    """A request sent whole on a connection of its own, its answer not read: close() is the client leaving."""
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {route} HTTP/1.1\r\nHost: verifier\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(client: httpx.Client, cond, what: str, timeout: float = 30.0) -> dict[str, float]:
    end = time.monotonic() + timeout
    while True:
        m = metrics(client)
        if cond(m):
            return m
        if time.monotonic() > end:
            raise AssertionError(f"not {what} within {timeout} s: {m}")
        time.sleep(0.05)


RUNNING, WAITING = 'ngram_verifier_requests{state="running"}', 'ngram_verifier_requests{state="waiting"}'
ABANDONED = 'ngram_verifier_http_abandoned_total{route="/v1/completions"}'


def long_request(n: int = 1, prompt: str = PROMPT, max_tokens: int = LONG) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "n": n}


def test_a_non_streaming_client_that_leaves_is_aborted(smollm2):
    with serve(smollm2) as (client, port, _):
        s = send(port, long_request())
        wait_for(client, lambda m: m[RUNNING] == 1 and m["ngram_verifier_generated_tokens_total"] > 0, "running")
        s.close()
        m = wait_for(client, lambda m: m[RUNNING] == 0 and m[WAITING] == 0, "freed")
        assert m["ngram_verifier_generated_tokens_total"] < LONG  # aborted, not decoded to its end
        assert m[ABANDONED] == 1
        # The slot is free again: a fresh request gets its answer.
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_requests_aborted_while_waiting_leave_the_queue_without_a_prefill(smollm2):
    with serve(smollm2) as (client, port, _):
        held = send(port, long_request())  # holds the engine's one slot
        wait_for(client, lambda m: m[RUNNING] == 1, "running")
        dropped = send(port, long_request(n=4, prompt="class Stack:"))
        before = wait_for(client, lambda m: m[WAITING] == 4, "queued")
        assert before["ngram_verifier_waiting_samples"] == 4
        dropped.close()
        m = wait_for(client, lambda m: m[WAITING] == 0, "dequeued")
        assert m[RUNNING] == 1 and m["ngram_verifier_waiting_tokens"] == 0
        assert m["ngram_verifier_prefill_tokens_total"] == before["ngram_verifier_prefill_tokens_total"]
        held.close()
        m = wait_for(client, lambda m: m[RUNNING] == 0, "freed")
        assert m[ABANDONED] == 2 and m["ngram_verifier_generated_tokens_total"] < LONG


def test_beyond_the_waiting_bound_requests_get_429(smollm2):
    with serve(smollm2, LifecycleConfig(max_waiting=4)) as (client, port, _):
        held = send(port, long_request())
        wait_for(client, lambda m: m[RUNNING] == 1, "running")
        queued = send(port, long_request(n=4))
        wait_for(client, lambda m: m[WAITING] == 4, "queued")
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "4 samples wait" in err["message"], err
        m = metrics(client)
        assert m['ngram_verifier_http_refused_total{reason="queue_requests",route="/v1/completions"}'] == 1
        assert m['ngram_verifier_http_requests_total{route="/v1/completions",status="429"}'] == 1
        queued.close()
        wait_for(client, lambda m: m[WAITING] == 0, "dequeued")
        # Room again: the same request is queued (its client leaves, and it is dequeued).
        again = send(port, {"prompt": PROMPT, "max_tokens": 2})
        wait_for(client, lambda m: m[WAITING] == 1, "queued")
        again.close()
        held.close()
        wait_for(client, lambda m: m[RUNNING] == 0 and m[WAITING] == 0, "freed")


def test_the_token_bound_and_an_empty_queue(smollm2):
    with serve(smollm2, LifecycleConfig(max_waiting_tokens=200)) as (client, port, _):
        held = send(port, long_request())
        wait_for(client, lambda m: m[RUNNING] == 1, "running")
        # Nothing waits: a request larger than the bound still gets in (else it never could).
        big = send(port, long_request(n=2, max_tokens=150))
        m = wait_for(client, lambda m: m[WAITING] == 2, "queued")
        tokens = m["ngram_verifier_waiting_tokens"]
        assert tokens > 300
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["message"].startswith(f"the server is busy: {tokens:.0f} tokens")
        assert metrics(client)['ngram_verifier_http_refused_total{reason="queue_tokens",route="/v1/completions"}'] == 1
        big.close()
        held.close()
        wait_for(client, lambda m: m[RUNNING] == 0 and m[WAITING] == 0, "freed")


def test_many_clients_that_give_up_are_each_freed(smollm2):
    with serve(smollm2, max_batch=2) as (client, port, _):
        socks = [send(port, long_request(n=2, prompt=f"def f{i}(x):")) for i in range(12)]
        wait_for(client, lambda m: m[RUNNING] == 2, "running")
        for s in socks:
            s.close()
        m = wait_for(client, lambda m: m[RUNNING] == 0 and m[WAITING] == 0 and m.get(ABANDONED, 0) == 12, "freed")
        assert m["ngram_verifier_waiting_tokens"] == 0
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


def test_a_body_cut_off_by_the_client_leaving_is_counted(smollm2):
    with serve(smollm2) as (client, port, _):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: verifier\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)  # (the handler is reading the body)
        s.close()
        m = wait_for(client, lambda m: m.get(ABANDONED, 0) == 1, "counted")
        assert m[WAITING] == 0 and m[RUNNING] == 0
        assert 'ngram_verifier_http_requests_total{route="/v1/completions",status="500"}' not in m


def test_while_draining_new_requests_get_503(smollm2):
    with serve(smollm2) as (client, port, app):
        app.state.lifecycle.draining = True  # what DrainingServer sets on SIGTERM (test_shutdown.py)
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        h = client.get("/healthz")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        m = metrics(client)
        assert m['ngram_verifier_http_refused_total{reason="draining",route="/v1/chat/completions"}'] == 1
        assert m[WAITING] == 0 and m[RUNNING] == 0


@pytest.mark.parametrize("field, value, needle", [
    ("max_waiting", 0, "max_waiting: expected an int 1..2^24"),
    ("max_waiting", True, "max_waiting"),
    ("max_waiting_tokens", 2**41, "max_waiting_tokens: expected an int 1..2^40"),
    ("shutdown_timeout", -1.0, "shutdown_timeout: expected seconds 0..3600"),
    ("shutdown_timeout", float("nan"), "shutdown_timeout"),
])
def test_lifecycle_config_is_validated(field, value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LifecycleConfig(**{field: value})
