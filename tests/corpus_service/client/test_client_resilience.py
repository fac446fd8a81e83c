"""The client when the corpus is down, restarting or slow: the circuit breaker, retries, and
re-creating per-request state on a new session after a server restart."""

from __future__ import annotations

import socket
import time

import pytest

from corpus_service.client import CorpusClient, CorpusUnavailable, RetryPolicy
from corpus_service.client.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from tests.corpus_service.service_fixtures import ServerProcess


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_and_half_opens_after_cooldown():
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(2):
        b.check()
        b.record_failure("down")
    assert b.state == CLOSED
    b.record_failure("down")
    assert b.state == OPEN
    with pytest.raises(CorpusUnavailable, match="circuit open"):
        b.check()
    clock.now = 5.0
    assert b.state == HALF_OPEN
    b.check()  # the one trial call
    with pytest.raises(CorpusUnavailable, match="trial"):
        b.check()
    b.record_failure("still down")  # the trial failed: open for another cool-down
    with pytest.raises(CorpusUnavailable):
        b.check()
    clock.now = 10.0
    b.check()
    b.record_success()
    assert b.state == CLOSED
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_corpus_costs_microseconds_once_the_breaker_is_open():
    port = _free_port()  # nothing listens here
    c = CorpusClient(f"127.0.0.1:{port}", timeout=1.0, retry=RetryPolicy(retries=2, backoff_s=0.001, max_backoff_s=0.002),
                     breaker=CircuitBreaker(failure_threshold=3, cooldown_s=60.0))
    try:
        c.start_request("r", [1, 2, 3])
        t0 = time.perf_counter()
        with pytest.raises(CorpusUnavailable):
            c.draft(["r"], 8)  # three attempts (retries), then the breaker opens
        first = time.perf_counter() - t0
        assert c.breaker.state == OPEN
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            with pytest.raises(CorpusUnavailable):
                c.draft(["r"], 8)
        per_call = (time.perf_counter() - t0) / n
        assert first < 1.0
        assert per_call < 200e-6, f"{per_call * 1e6:.1f} us per call with the breaker open"
        assert c.has_request("r")  # the local record survives, ready for replay
    finally:
        c.close()


def test_state_is_replayed_after_restart_and_kill(tmp_path):
    srv = ServerProcess(tmp_path).start()
    port = srv.grpc_port
    c = CorpusClient(srv.target, timeout=2.0, retry=RetryPolicy(retries=3, backoff_s=0.02, max_backoff_s=0.1),
                     breaker=CircuitBreaker(failure_threshold=2, cooldown_s=0.1))
    try:
        prompt = [7, 8, 9, 10, 11, 7, 8]
        c.start_request("r", prompt)
        c.extend("r", [9])
        before = c.draft(["r"], 5).tree(0)
        assert before[0][:2] == [10, 11]
        for how in ("sigterm", "kill"):
            before = c.draft(["r"], 5).tree(0)
            srv.stop() if how == "sigterm" else srv.kill()
            with pytest.raises(CorpusUnavailable):
                c.draft(["r"], 5)
            srv = ServerProcess(tmp_path).start(grpc_port=port)
            deadline = time.monotonic() + 10
            while True:  # the breaker lets a trial through once its cool-down passed
                try:
                    after = c.draft(["r"], 5).tree(0)
                    break
                except CorpusUnavailable:
                    assert time.monotonic() < deadline, how
                    time.sleep(0.05)
            assert after[0][:2] == before[0][:2], how  # the request's own context was replayed
            c.extend("r", before[0][:2])
    finally:
        c.close()
        if srv.alive():
            srv.stop()


def test_a_step_refused_for_its_draft_alone_keeps_its_operations(tmp_path):
    """The server marks a refusal of the draft request alone (Error.draft_only, not its text): the
    client keeps the step's start and extends pending and sends them with its next step; a step
    refused for an operation drops them (they would be refused again)."""
    from corpus_service.client import CorpusOutOfRange
    from corpus_service.protocol.status import CorpusError

    srv = ServerProcess(tmp_path, "--max-budget", "8", "--namespace", "default:vocab=100").start()
    c = CorpusClient(srv.target, timeout=5.0)
    try:
        c.start_request("r", [7, 8, 9, 10, 11, 7, 8])
        c.extend("r", [9])
        with pytest.raises(CorpusOutOfRange):
            c.draft(["r"], 9)  # deeper than the server's --max-budget
        assert c.draft(["r"], 5).tree(0)[0][:2] == [10, 11]  # started and extended by the retry

        c.start_request("s", [3, 4, 5, 3, 4, 500])  # refused by the server: outside the vocabulary
        with pytest.raises(CorpusError, match="vocabulary"):
            c.draft(["r"], 5)
        with pytest.raises(ValueError, match="unknown request id 's'"):  # the refused start was dropped
            c.draft(["s"], 5)
        assert c.draft(["r"], 5).tree(0)[0][:2] == [10, 11]
    finally:
        c.close()
        srv.stop()
