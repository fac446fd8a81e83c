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

    def start(self, timeout: float = 20.0, max_file_store: int | None = None) -> "NatsServer":
        """``max_file_store``: JetStream's storage limit in bytes (a broker too small for the stream)."""
        self.store.mkdir(parents=True, exist_ok=True)
        self._log = open(self.store / "nats.log", "ab")
        store = ["-sd", str(self.store)]
        if max_file_store is not None:
            conf = self.store / "nats.conf"
            conf.write_text(f'jetstream {{ store_dir: "{self.store}", max_file_store: {max_file_store} }}\n')
            store = ["-c", str(conf)]
        self.proc = subprocess.Popen([NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port), *store],
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
    return ServerProcess(data_dir, "--namespace", "default:flush_tokens=16", "--nats-url", nats.url, "--replica-id", replica_id,
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


def commit(target: str, rid: str, prompt: list[int], runs: list[list[int]]) -> None:
    """One request committed through a real client session: start, extend run by run (each step
    also drafts, as a verifier does), finish."""
    from corpus_service.client import CorpusClient

    with CorpusClient(target, timeout=10) as c:
        c.start_request(rid, prompt)
        for run in runs:
            c.draft([rid], 4)
            c.extend(rid, run)
        c.finish(rid)
        c.flush()


def drafts(target: str, context: list[int], budget: int = 8) -> list[int]:
    """The tokens of a fresh request's draft tree for ``context`` (its first path first)."""
    from corpus_service.client import CorpusClient

    with CorpusClient(target, timeout=10) as c:
        c.start_request("probe", context)
        tokens, _, _ = c.draft(["probe"], budget).tree(0)
        c.finish("probe")
        return tokens


def drafts_continuation(target: str, doc: list[int], k: int = 8) -> bool:
    """Whether a replica drafts ``doc``'s next tokens after its first ``k`` (the commit is visible)."""
    return drafts(target, doc[:k], 4)[:3] == doc[k:k + 3]


def metrics(srv: ServerProcess) -> dict[str, float]:
    """The server's Prometheus samples without labels: name -> value."""
    out = {}
    for line in httpx.get(f"{srv.admin_url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def stream_config(nats: NatsServer, stream: str = "ngram-corpus"):
    """The stream's configuration as the broker holds it (nats-py)."""
    import asyncio

    import nats as nats_py

    async def read():
        nc = await nats_py.connect(nats.url)
        try:
            return (await nc.jetstream().stream_info(stream)).config
        finally:
            await nc.close()

    return asyncio.run(read())


def delete_stream(nats: NatsServer, stream: str = "ngram-corpus") -> None:
    import asyncio

    import nats as nats_py

    async def delete():
        nc = await nats_py.connect(nats.url)
        try:
            await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()

    asyncio.run(delete())


__all__ = ["NATS_SERVER", "NatsServer", "TOKEN", "commit", "converged", "delete_stream", "drafts",
           "drafts_continuation", "metrics", "replica", "status", "stream_config", "wait_for", "wait_ready"]


def replica_cluster(tmp_path: Path, *common: str):
    """Body of a ``cluster`` fixture: a nats-server and ``start(name, *extra)`` for replicas on it
    (``common`` flags first); everything started is killed at teardown. Use with ``yield from``."""
    nats = NatsServer(tmp_path / "nats").start()
    started: list[ServerProcess] = []

    def start(name: str, *extra: str) -> ServerProcess:
        srv = replica(tmp_path / name, nats, name, tmp_path / "blobs", *common, *extra).start()
        started.append(srv)
        return srv

    try:
        yield nats, start
    finally:
        for srv in started:
            if srv.alive():
                srv.kill()
        nats.kill()
