"""Checks that a server process survived what a test threw at it: it answers both ports, and its
resident memory stayed within a bound."""

from __future__ import annotations

import grpc

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def assert_alive(srv, channel: grpc.Channel | None = None, http=None) -> None:
    """The process runs, the Stats RPC answers and /healthz says ok (fresh connections unless given)."""
    assert srv.alive(), srv.log()
    if channel is None:
        with grpc.insecure_channel(srv.target) as ch:
            pb_grpc.CorpusStub(ch).Stats(pb.StatsRequest(), timeout=30)
    else:
        pb_grpc.CorpusStub(channel).Stats(pb.StatsRequest(), timeout=30)
    if http is None:
        with srv.http(token=None) as client:
            r = client.get("/healthz")
    else:
        r = http.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
