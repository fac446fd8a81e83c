"""SIGTERM drains a real ``ngram-verifier serve`` (the real SmolLM2 on the CPU, 127.0.0.1, an
ephemeral port): the listener closes, requests running or waiting get --shutdown-timeout to finish
and are then aborted (their clients get an answer that says so), and the process exits 0."""

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from tests.verifier.api.test_lifecycle import RUNNING, WAITING, long_request, send, wait_for

LONG = 900  # output tokens: minutes of CPU decoding, far past the shutdown deadline


def read_answer(s: socket.socket, timeout: float = 60.0) -> tuple[int, dict]:
    """The HTTP status and JSON body the server answers on ``s`` (it closes the connection after)."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture
def verifier(smollm2, tmp_path):  # (smollm2: skips where the model is not installed)
    ports = tmp_path / "ports.json"
    p = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", "smollm2", "--corpus", "none",
                          "--port", "0", "--ports-file", str(ports), "--max-batch", "1", "--max-len", "1024",
                          "--shutdown-timeout", "2", "--log-level", "WARNING"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 180
        while not ports.exists():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < end, "the verifier did not start"
            time.sleep(0.1)
        yield p, json.loads(ports.read_text())["http_port"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigterm_aborts_at_the_deadline_and_exits_0(verifier):
    p, port = verifier
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        held = send(port, long_request(max_tokens=LONG))
        wait_for(client, lambda m: m[RUNNING] == 1, "running", timeout=120)
        queued = send(port, long_request(prompt="class Stack:", max_tokens=LONG))
        wait_for(client, lambda m: m[WAITING] == 1, "queued")
    p.send_signal(signal.SIGTERM)
    # The running and the waiting request are answered: aborted at the deadline, not decoded on.
    for s, started in ((held, True), (queued, False)):
        status, body = read_answer(s)
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "abort", body
        assert body["usage"]["completion_tokens"] < LONG
        assert (body["usage"]["completion_tokens"] > 0) == started  # the waiting one was never prefilled
        s.close()
    # New requests are refused: the listener is closed.
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert p.wait(timeout=60) == 0, p.stdout.read()
    out = p.stdout.read()
    assert "aborted 2 live requests" in out and "Traceback" not in out, out

