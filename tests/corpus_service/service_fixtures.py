"""Real corpus server processes on 127.0.0.1 ephemeral ports, for the service tests."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from bench.common import CorpusServer

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-admin-token-0123456789"


class ServerProcess(CorpusServer):
    """The benchmarks' corpus server process (``bench.common.CorpusServer``) as the service tests
    run it: persistent in ``data_dir``, the REST admin on, an admin token, a 1 s drain, the
    server's own log level (tests read its log)."""

    def __init__(self, data_dir: Path, *args: str, env: dict | None = None, admin_token: str | None = TOKEN) -> None:
        """``admin_token``: None starts a loopback server without one (gRPC Reset and external
        corpora then need no token; with one they need it, as REST writes do)."""
        super().__init__(data_dir, "--drain-timeout-s", "1", *args, persist=True, admin=True,
                         admin_token=admin_token, log_level=None, env=env)

    def start(self, grpc_port: int = 0, admin_port: int = 0, timeout: float = 30.0) -> "ServerProcess":
        super().start(grpc_port, admin_port, timeout)
        return self


def wait_job(http: httpx.Client, job_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: {job}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One shared server per test module: namespaces 'default', 'small' (vocab 1000) and 'smollm2'
    (the real SmolLM2 tokenizer, loaded on the first text upload)."""
    srv = ServerProcess(tmp_path_factory.mktemp("corpus"), "--namespace", "default", "--namespace", "small:vocab=1000",
                        "--namespace", "smollm2:vocab=49152,tokenizer=smollm2",
                        "--max-budget", "32", "--max-batch", "128", "--max-live-requests-per-session", "64",
                        "--max-upload-bytes", "1000000")
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()
