"""ServiceState: what the gRPC servicer and the REST admin of one process share."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from corpus_service.auth import Authenticator
from corpus_service.engine import NgramCorpus
from corpus_service.metrics import Metrics
from corpus_service.namespaces import Namespaces
from corpus_service.rate_limit import RateLimiter
from corpus_service.service_config import NamespaceSpec, ServiceConfig

log = logging.getLogger("corpus_service")
T = TypeVar("T")


class ServiceState:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.specs: dict[str, NamespaceSpec] = {s.name: s for s in config.parsed_namespaces}
        self.namespaces = Namespaces()
        for spec in config.parsed_namespaces:
            self.namespaces.create(spec.name, spec.corpus)
        # Engine calls release the GIL, so a pool of threads runs them in parallel off the loop.
        self.executor = ThreadPoolExecutor(config.resolved_worker_threads(), thread_name_prefix="corpus")
        self.metrics = Metrics(self.engine_stats)
        # Who may call what (auth.py), and per-caller limits on mutating admin calls and BatchPut.
        self.auth = Authenticator(config.parsed_client_tokens, config.admin_token)
        self.admin_limit = RateLimiter("mutating admin calls", config.admin_rate_per_s, config.admin_rate_burst)
        self.put_limit = RateLimiter("BatchPut calls", config.put_rate_per_s, config.put_rate_burst)
        self.draining = False
        self.ready = False
        self.live_sessions = 0
        self._session_ids = itertools.count(1)
        self.snapshot_errors: dict[str, str] = {}  # namespace -> why its snapshot was refused at start
        self.not_ready_reason = ""  # what /readyz says while not ready (a replica bootstrapping, catching up)
        # Replicated (--log): namespace -> Chunker; commits go to the log, not straight to the engine.
        self.chunkers: dict | None = None
        self.replica = None  # the Replica (corpus_service/replication) when replicated

    def corpus(self, namespace: str) -> NgramCorpus:
        """The namespace's engine; KeyError (-> NOT_FOUND / 404) names the known ones."""
        if not isinstance(namespace, str) or namespace not in self.specs:
            raise KeyError(f"unknown namespace {namespace!r} (known: {sorted(self.specs)})")
        return self.namespaces.get(namespace)

    def next_session_id(self) -> int:
        return next(self._session_ids)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def engine_stats(self) -> dict[str, dict[str, float]]:
        return {name: self.namespaces.get(name).stats() for name in self.specs}

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
