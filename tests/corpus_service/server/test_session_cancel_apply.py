"""A Session cancelled while one of its steps is applied on the server's worker pool: the requests that
step starts must end with the stream (before, they stayed live on the engine, unknown to any stream,
until the engine's idle timeout: 133 live against 129 after a client's missed deadlines, 2026-12-06)."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.protocol import arrays
from tests.corpus_service.server.test_caller_limits import limit_used, live_requests, metrics, wait_until
from tests.corpus_service.service_fixtures import ServerProcess

N, PROMPT = 192, 4000  # ~770K tokens in one step: tens of milliseconds of work on the pool


def test_requests_a_cancelled_streams_last_step_starts_end_with_it(tmp_path):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, PROMPT).astype(np.int32) for _ in range(N)]
    srv = ServerProcess(tmp_path, "--namespace", "default", "--max-live-request-bytes", str(1 << 30)).start()
    try:
        with grpc.insecure_channel(srv.target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.CorpusStub(ch)
            for trial, delay in enumerate((0.0, 0.01, 0.03, 0.06, 0.1, 0.2)):
                msg = pb.SessionRequest(seq=0, namespace="default")
                arrays.pack_runs(msg.start, [f"t{trial}-{i}" for i in range(N)], prompts)
                gone = threading.Event()

                def steps(msg=msg, gone=gone):
                    yield msg
                    gone.wait(30)  # the stream stays open until the client cancels it

                call = stub.Session(steps())
                time.sleep(delay)
                call.cancel()
                gone.set()
        # Every trial's requests end with its stream (the engine's idle timeout is minutes away).
        wait_until(lambda: live_requests(srv) == 0, timeout=20)
        assert limit_used(srv, "live_request_bytes") == 0
        # The streams reached the server: those cancelled 60 ms or more after sending surely did (an
        # immediate cancel may beat the call to the server on a loaded machine: 5 of 6 once in CI).
        assert metrics(srv)[("ngram_corpus_sessions_total", ())] >= 3
    finally:
        srv.stop()
