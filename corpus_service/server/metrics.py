"""Prometheus metrics of one service process (its own registry, so several servers can share a
Python process in tests). Corpus sizes and memory are read from the engines at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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


class _LimitCollector(Collector):
    """Per-caller memory limits (live_budget.py, batch_clients.py), read at scrape time:
    name -> (configured limit, current use, calls refused by it)."""

    def __init__(self, read: Callable[[], dict[str, tuple[float, float, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = sorted(self._read().items())
        families = (GaugeMetricFamily("ngram_corpus_limit", "Configured per-caller limit", labels=["limit"]),
                    GaugeMetricFamily("ngram_corpus_limit_used", "Current use of each per-caller limit", labels=["limit"]),
                    CounterMetricFamily("ngram_corpus_limit_refused", "Calls refused by each per-caller limit",
                                        labels=["limit"]))
        for name, values in rows:
            for family, value in zip(families, values):
                family.add_metric([name], float(value))
        yield from families


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
        self.tokenizer_errors = Counter("ngram_corpus_tokenizer_errors", "Namespace tokenizers that failed to load",
                                        ["namespace"], registry=r)
        self.damaged_corpora = Counter("ngram_corpus_damaged_corpora", "External corpora found damaged (an unreadable "
                                       "manifest, a truncated data file), once per episode", ["namespace"], registry=r)
        self.snapshots = Counter("ngram_corpus_snapshots", "Snapshots written", ["namespace", "result"], registry=r)
        self.batch_get_expired = Counter("ngram_corpus_batch_get_expired_requests",
                                         "BatchGet request ids erased after batch_get_idle_s unused", registry=r)
        self.sessions_cancelled = Counter("ngram_corpus_sessions_cancelled",
                                          "Session streams cancelled by their client (ended without a traceback)", registry=r)
        self.outages = Counter("ngram_corpus_dependency_outages", "Outages of a dependency (one per episode)",
                               ["dependency"], registry=r)
        self.dependency_down = Gauge("ngram_corpus_dependency_down", "1 while a dependency is unavailable",
                                     ["dependency"], registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        r.register(_EngineCollector(read_stats))

    def watch_limits(self, read: Callable[[], dict[str, tuple[float, float, float]]]) -> None:
        self.registry.register(_LimitCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Replication (corpus_service/replication/): read from the replica's status at scrape time.
_REPLICATION_GAUGES = {
    "applied_seq": "Stream sequence of the newest log message applied here",
    "published_seq": "Stream sequence of this replica's newest acknowledged batch",
    "stream_last_seq": "Newest stream sequence this replica has seen",
    "lag_messages": "Log messages stored but not applied here yet (pending)",
    "lag_seconds": "While messages are pending: how far the newest applied commit is behind now (0 when caught up)",
    "buffered_tokens": "Committed tokens waiting to be published (bounded by --log-buffer-tokens)",
    "stream_healthy": "1 while this replica follows the commit log stream; 0 from finding it lost until recovered",
    "connected": "1 while connected to the broker",
    "read_only": "1 while serving a snapshot because the broker has been unreachable since start",
    "snapshot_seq": "Stream sequence of the newest snapshot this replica wrote or loaded",
    "snapshot_age_seconds": "Age of the newest snapshot this replica wrote or loaded",
    "snapshot_writing": "1 while a snapshot writer runs",
}
_REPLICATION_COUNTERS = {
    "published_tokens": "Committed tokens published to the log",
    "publish_errors": "Failed publish attempts (the batch is kept and retried)",
    "dropped_tokens": "Committed tokens dropped because the publish buffer was full",
    "dropped_chunks": "Chunks dropped because the publish buffer was full",
    "drop_episodes": "Episodes of dropped commits (each logged once)",
    "applied_tokens": "Tokens applied from the log",
    "stream_losses": "Times the stream was found gone or recreated",
    "gaps": "Retention gaps: log messages lost before this replica applied them",
    "snapshots_written": "Snapshots written by this replica",
    "snapshot_errors": "Snapshots that failed",
}
_STATUS_KEYS = {"lag_messages": "pending", "snapshot_age_seconds": "snapshot_age_s"}


class _ReplicationCollector(Collector):
    def __init__(self, read_status: Callable[[], dict]) -> None:
        self._read = read_status

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._read()
        for key, help_text in _REPLICATION_GAUGES.items():
            v = st.get(_STATUS_KEYS.get(key, key))
            yield GaugeMetricFamily(f"ngram_corpus_replication_{key}", help_text,
                                    value=float(max(v, 0) if isinstance(v, (int, float)) else 0))
        for key, help_text in _REPLICATION_COUNTERS.items():
            yield CounterMetricFamily(f"ngram_corpus_replication_{key}", help_text, value=float(st.get(key) or 0))


class ReplicationMetrics:
    """The replica's metrics in the process' registry: gauges and counters read from its status at
    scrape time, histograms observed as batches apply and snapshots finish."""

    def __init__(self, metrics: Metrics, read_status: Callable[[], dict]) -> None:
        r = metrics.registry
        self.visible = Histogram("ngram_corpus_replication_visible_seconds",
                                 "Commit-to-visible time of each applied batch (commit cut to applied here)",
                                 buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
                                 registry=r)
        self.snapshot_seconds = Histogram("ngram_corpus_replication_snapshot_seconds",
                                          "Time to write a snapshot (fork to record written)",
                                          buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.snapshot_pause = Histogram("ngram_corpus_replication_snapshot_pause_seconds",
                                        "Time applying and drafting were held for a snapshot (the fork)",
                                        buckets=(1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0), registry=r)
        r.register(_ReplicationCollector(read_status))
