"""A real ``nats-server -js`` on 127.0.0.1 and corpus replicas attached to it, for the replication tests.

The tests skip (with the reason) when nats-server is not installed; ``.ci/run`` installs it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.corpus_service.service_fixtures import TOKEN, ServerProcess

NATS_SERVER = shutil.which("nats-server") or next(
    (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if Path(p).is_file()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """nats-server with JetStream on a fixed loopback port and store directory, so a restart keeps
    the same address and stream."""

    def __init__(self, store: Path) -> None:
        self.store = Path(store)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "NatsServer":
        self.store.mkdir(parents=True, exist_ok=True)
        self._log = open(self.store / "nats.log", "ab")
        self.proc = subprocess.Popen([NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: {(self.store / 'nats.log').read_text()[-2000:]}")
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def replica(data_dir: Path, nats: NatsServer, replica_id: str, blobs: Path, *extra: str) -> ServerProcess:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return ServerProcess(data_dir, "--namespace", "default:flush_tokens=16", "--log", nats.url, "--replica-id", replica_id,
                         "--blob-store", str(blobs), "--log-batch-ms", "1", "--ready-lag", "0", *extra)


def status(srv: ServerProcess, digest: bool = False) -> dict:
    r = httpx.get(f"{srv.admin_url}/v1/replication", params={"digest": str(digest).lower()}, timeout=30)
    r.raise_for_status()
    return r.json()


def wait_for(pred, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_ready(srv: ServerProcess, timeout: float = 60.0) -> None:
    wait_for(lambda: httpx.get(f"{srv.admin_url}/readyz", timeout=5).status_code == 200, timeout, "readyz")


def converged(servers: list[ServerProcess], timeout: float = 60.0) -> list[dict]:
    """Waits until every replica applied the same log position with nothing published pending, then
    returns their statuses with digests."""
    def check():
        st = [status(s) for s in servers]
        if any(x["buffered_tokens"] or x["pending"] != 0 for x in st):
            return None
        if len({x["applied_seq"] for x in st}) != 1:
            return None
        full = [status(s, digest=True) for s in servers]
        if len({x["digest_seq"] for x in full}) != 1:
            return None
        return full
    return wait_for(check, timeout, "replicas to converge")


__all__ = ["NATS_SERVER", "NatsServer", "TOKEN", "converged", "replica", "status", "wait_for", "wait_ready"]
