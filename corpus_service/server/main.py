"""CorpusService: one process serving gRPC (drafts) and the REST admin on one event loop.

Start-up: restore snapshots and rebuild acknowledged uploads, bind both ports (0 = ephemeral; the
bound ports are logged and written to ``ports_file``), mark health SERVING. SIGTERM/SIGINT: refuse
new work (UNAVAILABLE / 503), give open streams ``drain_timeout_s`` to finish, stop, snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import tempfile
from pathlib import Path

import grpc
import uvicorn
from prometheus_client import Gauge
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2
from corpus_service.admin.app import create_admin_app
from corpus_service.admin.catalog import Catalog
from corpus_service.admin.persistence import DataDir
from corpus_service.security.auth import AuthInterceptor
from corpus_service.security.config import security_warnings
from corpus_service.security.tls import server_credentials
from corpus_service.server.config import ServiceConfig, deprecations
from corpus_service.server.grpc_server import CorpusServicer, keepalive_options
from corpus_service.server.handlers import add_corpus_servicer
from corpus_service.server.state import ServiceState
from ngram_common.gc_heap import freeze_startup_heap

log = logging.getLogger("corpus_service")
SERVICE_NAME = corpus_pb2.DESCRIPTOR.services_by_name["Corpus"].full_name


class _AdminServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM and shuts both down."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def connection_age_options(age_s: float) -> list[tuple[str, int]]:
    """gRPC server options that make clients reconnect after ``age_s`` (0: never), so a client's
    channel reaches replicas added since it connected. gRPC adds +-10% jitter to the age; streams
    still open then get a grace of a tenth of it (at most 30 s) before they are cut (a Session the
    client replays on a new stream)."""
    if not age_s:
        return []
    return [("grpc.max_connection_age_ms", max(1, int(age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", max(1, int(min(30.0, age_s / 10) * 1000)))]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CorpusService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        # Without a data directory the service still needs one for uploads in flight: a temporary one.
        self._tmp = None if config.persistent else tempfile.TemporaryDirectory(prefix="ngram-corpus-")
        self.data = DataDir(config.data_dir if config.persistent else self._tmp.name)
        if config.persistent:  # before anything reads it: DataDirInUse if another server has it
            self.data.lock()
        self.state = ServiceState(config)
        persistent = Gauge("ngram_corpus_persistent", "1 when snapshots and uploads are kept in a data directory; "
                           "0 with --data-dir '' (nothing persists)", registry=self.state.metrics.registry)
        persistent.set(1 if config.persistent else 0)
        self.catalog = Catalog(self.state, self.data, persistent=config.persistent)
        self.replica = None
        if config.replicated:  # imported only here: a single node needs no broker client
            from corpus_service.replication.service import make_replica
            self.replica = make_replica(config, self.state, self.catalog, self.data)
        self.grpc_port: int | None = None
        self.admin_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._admin: _AdminServer | None = None
        self._admin_task: asyncio.Task | None = None
        self._snapshot_task: asyncio.Task | None = None
        self._health = health_aio.HealthServicer()
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        if cfg.persistent:
            log.info("data directory: %s (snapshots and uploads are kept there; --data-dir '' keeps nothing)",
                     cfg.data_dir)
        else:  # once, at start: an explicit choice, but one that loses everything at the next stop
            log.warning("no data directory (--data-dir ''): nothing persists; uploads and the learned corpus are "
                        "lost when the service stops (--data-dir DIR or NGRAM_CORPUS_DATA_DIR keeps them)")
        if self.replica is None:
            await asyncio.to_thread(self.catalog.restore)
        else:  # the replica bootstraps from the newest snapshot in the blob store and the log
            await asyncio.to_thread(self.data.clean_incoming)
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]  # two servers must never share a port by accident
        opts += connection_age_options(cfg.grpc_max_connection_age_s)
        opts += keepalive_options()  # what the clients' keepalive pings need (no too_many_pings GOAWAY)
        interceptors = []
        # Client tokens: every call needs one. Only the admin token: the admin methods need it. Neither:
        # gRPC stays open and pays nothing.
        if self.state.auth.required or self.state.auth.has_admin_token:
            refused = self.state.metrics.auth_refused
            interceptors.append(AuthInterceptor(self.state.auth, lambda code: refused.labels("grpc", code).inc()))
        self._grpc = grpc.aio.server(options=opts, interceptors=interceptors)
        add_corpus_servicer(CorpusServicer(self.state, self.catalog), self._grpc)  # malformed messages -> INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._grpc)
        if cfg.tls_cert:
            creds = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            self.grpc_port = self._grpc.add_secure_port(_hostport(cfg.host, cfg.grpc_port), creds)
        else:
            self.grpc_port = self._grpc.add_insecure_port(_hostport(cfg.host, cfg.grpc_port))
        if not self.grpc_port:
            raise OSError(f"cannot bind gRPC to {_hostport(cfg.host, cfg.grpc_port)}")
        await self._grpc.start()
        if cfg.admin_port >= 0:
            await self._start_admin()
        for ns in self.state.specs:  # loaded in the background, so the first Stats answers at once
            if self.state.tokenizers.has(ns):
                self.state.tokenizer_probe(ns)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.replica is None:
            self.state.ready = True
        else:
            await self.replica.start()  # ready once bootstrapped and caught up with the log
        if cfg.snapshot_interval_s > 0 and self.catalog.persistent and self.replica is None:
            self._snapshot_task = asyncio.create_task(self._snapshot_loop())
        scheme = "https" if cfg.tls_cert else "http"
        admin = f"{scheme}://{_hostport(cfg.host, self.admin_port)}" if self.admin_port is not None else "off"
        for warning in security_warnings(cfg) + deprecations(cfg):
            log.warning("%s", warning)
        log.info("ngram-corpus listening: grpc=%s admin=%s namespaces=%s data_dir=%s",
                 _hostport(cfg.host, self.grpc_port), admin, ",".join(self.state.specs), cfg.data_dir or "(none: '')")
        if cfg.ports_file:
            tmp = Path(cfg.ports_file).with_name(Path(cfg.ports_file).name + ".tmp")
            tmp.write_text(json.dumps({"grpc_port": self.grpc_port, "admin_port": self.admin_port, "pid": os.getpid()}))
            os.replace(tmp, cfg.ports_file)

    async def _start_admin(self) -> None:
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.admin_port))
        self.admin_port = sock.getsockname()[1]
        app = create_admin_app(self.state, self.catalog)
        if self.replica is not None:
            from corpus_service.replication.routes import replication_router
            from fastapi import Depends

            # With client tokens, the replica's status (every namespace) needs read on all of them.
            app.include_router(replication_router(self.replica), dependencies=[Depends(app.state.require_read_all)])
        tls = {}
        if cfg.tls_cert:
            tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
            if cfg.tls_client_ca:
                tls.update(ssl_ca_certs=cfg.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        ucfg = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **tls,
                              timeout_graceful_shutdown=max(1, int(cfg.drain_timeout_s)))
        self._admin = _AdminServer(ucfg)
        self._admin_task = asyncio.create_task(self._admin.serve(sockets=[sock]))
        while not self._admin.started:
            if self._admin_task.done():
                self._admin_task.result()  # re-raises the start-up failure
                raise OSError("the REST admin stopped during start-up")
            await asyncio.sleep(0.01)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_interval_s)
            try:
                await self.catalog.snapshot()
            except Exception as e:  # noqa: BLE001 - a failed periodic snapshot must not stop serving
                # Once per outage (outages.py), not once per interval.
                self.state.outages.down("data directory", f"periodic snapshot failed ({type(e).__name__}: {e})",
                                        exc_info=True)
            else:
                self.state.outages.up("data directory")

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain, stop both servers, finish builds, snapshot."""
        state = self.state
        state.draining = True
        await self._health.enter_graceful_shutdown()
        log.info("draining: %d open session(s), %.1fs grace", state.live_sessions, self.config.drain_timeout_s)
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
        if self._grpc is not None:
            await self._grpc.stop(self.config.drain_timeout_s)
        if self._admin is not None:
            self._admin.should_exit = True
            await self._admin_task
        if self.replica is not None:  # sessions are closed: their last chunks are queued
            await self.replica.stop(self.config.drain_timeout_s)
        await asyncio.to_thread(self.catalog.jobs.shutdown)
        if self.catalog.persistent and self.replica is None:
            try:
                done = await self.catalog.snapshot()
                log.info("shutdown snapshot written: %s", ", ".join(done.values()))
            except Exception:  # noqa: BLE001
                log.exception("shutdown snapshot failed")
        state.close()
        self.data.unlock()
        if self._tmp is not None:
            self._tmp.cleanup()
        log.info("stopped")


async def serve(config: ServiceConfig) -> None:
    """Runs until SIGTERM or SIGINT."""
    service = CorpusService(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    try:
        await service.start()
    except BaseException:
        await service.stop()
        raise
    log.info("start-up heap frozen: %d objects out of the garbage collector's scans", freeze_startup_heap())
    await service.wait()
    await service.stop()
