"""ServiceState: what the gRPC servicer and the REST admin of one process share."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from corpus_service.engine.corpus import NgramCorpus
from corpus_service.engine.namespaces import Namespaces
from corpus_service.engine.tokenizer import Tokenizers
from corpus_service.security.auth import Authenticator
from corpus_service.security.rate_limit import RateLimiter
from corpus_service.server.batch_clients import BatchClients
from corpus_service.server.config import NamespaceSpec, ServiceConfig
from corpus_service.server.live_budget import LiveBudget, token_charge_bytes
from corpus_service.server.metrics import Metrics
from corpus_service.server.outages import Outages
from corpus_service.server.reclaim import Reclaimer

log = logging.getLogger("corpus_service")
T = TypeVar("T")


class ServiceState:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.specs: dict[str, NamespaceSpec] = {s.name: s for s in config.parsed_namespaces}
        self.namespaces = Namespaces()
        # Loaded on first use (text uploads, the tokenizer probe of Stats).
        self.tokenizers = Tokenizers({s.name: s.tokenizer for s in config.parsed_namespaces})
        for spec in config.parsed_namespaces:
            # Replicated, a rank model learns from the log's deltas (every replica's, its own included)
            # rather than from its own commits, so all replicas hold the same one (replication/replica.py).
            corpus = spec.corpus.replace(rank_learn_local=False) if config.replicated and spec.corpus.rank_model else spec.corpus
            self.namespaces.create(spec.name, corpus)
        # Engine calls release the GIL, so a pool of threads runs them in parallel off the loop.
        self.executor = ThreadPoolExecutor(config.resolved_worker_threads(), thread_name_prefix="corpus")
        self.metrics = Metrics(self.engine_stats)
        # Who may call what (security/auth.py), and per-caller limits on mutating admin calls and BatchPut.
        self.auth = Authenticator(config.parsed_client_tokens, config.admin_token)
        self.admin_limit = RateLimiter("mutating admin calls", config.admin_rate_per_s, config.admin_rate_burst)
        self.put_limit = RateLimiter("BatchPut calls", config.put_rate_per_s, config.put_rate_burst)
        # Per-caller memory: every live request charged to one budget; BatchGet state bounded and expired.
        self.budget = LiveBudget(config.max_live_request_bytes)
        self.token_bytes = {s.name: token_charge_bytes(s.corpus) for s in config.parsed_namespaces}
        self.batch_clients = BatchClients(self.budget, config.max_batch_get_clients,
                                          config.max_batch_get_requests_per_client, config.batch_get_idle_s)
        self.reclaimer = Reclaimer()
        self.outages = Outages(self.metrics.outages, self.metrics.dependency_down)  # logged once per episode
        self.metrics.watch_limits(self.limit_stats)
        self.draining = False
        self.ready = False
        self.live_sessions = 0
        self._session_ids = itertools.count(1)
        self.snapshot_errors: dict[str, str] = {}  # namespace -> why its snapshot was refused at start
        self.tokenizer_errors: dict[str, str] = {}  # namespace -> why its tokenizer cannot be loaded
        self._probes: dict[str, asyncio.Future] = {}  # namespace -> its tokenizer probe (loaded once)
        self.not_ready_reason = ""  # what /readyz says while not ready (a replica bootstrapping, catching up)
        # Replicated (--log): namespace -> Chunker; commits go to the log, not straight to the engine.
        self.chunkers: dict | None = None
        self.replica = None  # the Replica (corpus_service/replication) when replicated

    def corpus(self, namespace: str) -> NgramCorpus:
        """The namespace's engine; KeyError (-> NOT_FOUND / 404) names the known ones."""
        if not isinstance(namespace, str) or namespace not in self.specs:
            raise KeyError(f"unknown namespace {namespace!r} (known: {sorted(self.specs)})")
        return self.namespaces.get(namespace)

    def tokenizer_probe(self, namespace: str) -> "asyncio.Future[list[int]]":
        """PROBE_TEXT's ids under the namespace's tokenizer, loaded once off the loop ([] without a
        tokenizer, or when it cannot be loaded: then ``tokenizer_errors`` says why)."""
        task = self._probes.get(namespace)
        if task is None:
            task = self._probes[namespace] = asyncio.ensure_future(self._load_probe(namespace))
        return asyncio.shield(task)

    async def _load_probe(self, namespace: str) -> list[int]:
        try:
            return await asyncio.to_thread(self.tokenizers.probe, namespace)
        except Exception as e:  # noqa: BLE001 - reported in Stats, /v1/namespaces and the metric
            log.error("namespace '%s': tokenizer %s cannot be loaded: %s", namespace,
                      self.specs[namespace].tokenizer, e)
            # What clients see names the spec, not the server's paths; the log has the detail.
            self.tokenizer_errors[namespace] = (f"tokenizer '{self.tokenizers.name(namespace)}' cannot be loaded "
                                                f"({type(e).__name__}; see the corpus server's log)")
            self.metrics.tokenizer_errors.labels(namespace).inc()
            return []

    def next_session_id(self) -> int:
        return next(self._session_ids)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def limit_stats(self) -> dict[str, tuple[int, int, int]]:
        """Per-caller limits: name -> (limit, current use, refusals), exported in /metrics."""
        b, bc = self.budget, self.batch_clients
        return {"live_request_bytes": (b.limit, b.used, b.refused),
                "batch_get_clients": (bc.max_clients, len(bc), bc.refused["clients"]),
                "batch_get_requests_per_client": (bc.max_requests_per_client, bc.largest_client(),
                                                  bc.refused["requests_per_client"])}

    def engine_stats(self) -> dict[str, dict[str, int | float]]:
        return {name: self.namespaces.get(name).stats() for name in self.specs}

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
