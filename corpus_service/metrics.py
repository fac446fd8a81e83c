"""Prometheus metrics of one service process (its own registry, so several servers can share a
Python process in tests). Corpus sizes and memory are read from the engines at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds: a decode step is 0.1-10 ms; uploads and snapshots take longer.
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5, 10.0)
_NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
# Engine statistics exported as gauges: name -> help.
_ENGINE_GAUGES = {
    "learned_tokens": "Tokens committed to the learned corpus",
    "learned_stored_tokens": "Tokens the learned corpus currently stores (after eviction)",
    "learned_bytes": "Bytes held by the learned corpus",
    "external_tokens": "Tokens in committed external corpora",
    "external_bytes": "Bytes held by external corpora",
    "external_corpora": "Committed external corpora",
    "live_requests": "Live requests (all sessions and BatchGet clients)",
    "live_groups": "Live request groups (the n samples of one prompt drafting from each other)",
    "live_request_bytes": "Bytes held by the live requests' context indexes",
    "pending_inserts": "Queued learned-corpus inserts",
}


class _EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], dict[str, dict[str, float]]]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._read_stats()
        for key, help_text in _ENGINE_GAUGES.items():
            g = GaugeMetricFamily(f"ngram_corpus_{key}", help_text, labels=["namespace"])
            for ns, values in sorted(stats.items()):
                g.add_metric([ns], float(values.get(key, 0.0)))
            yield g


class Metrics:
    def __init__(self, read_stats: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rpc_total = Counter("ngram_corpus_grpc_requests", "gRPC calls (session steps count one each)",
                                 ["method", "code"], registry=r)
        self.rpc_latency = Histogram("ngram_corpus_grpc_latency_seconds", "Server-side handling time",
                                     ["method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.draft_nodes = Histogram("ngram_corpus_draft_nodes", "Nodes per drafted tree",
                                     ["namespace"], buckets=_NODE_BUCKETS, registry=r)
        self.sessions = Counter("ngram_corpus_sessions", "Session streams opened", registry=r)
        self.http_total = Counter("ngram_corpus_http_requests", "REST admin requests",
                                  ["method", "route", "status"], registry=r)
        self.http_latency = Histogram("ngram_corpus_http_latency_seconds", "REST admin handling time",
                                      ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.upload_bytes = Counter("ngram_corpus_upload_bytes", "Bytes of external corpora received", registry=r)
        self.auth_refused = Counter("ngram_corpus_auth_refused", "Calls refused for their credentials",
                                    ["surface", "code"], registry=r)
        self.rate_limited = Counter("ngram_corpus_rate_limited", "Calls refused by a rate limit",
                                    ["surface", "limit"], registry=r)
        self.snapshots = Counter("ngram_corpus_snapshots", "Snapshots written", ["namespace", "result"], registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        r.register(_EngineCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
