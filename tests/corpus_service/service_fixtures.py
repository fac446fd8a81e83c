"""Real corpus server processes on 127.0.0.1 ephemeral ports, for the service tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-admin-token-0123456789"


class ServerProcess:
    """``python -m corpus_service serve`` with ports read back from its ports file."""

    def __init__(self, data_dir: Path, *args: str, env: dict | None = None, admin_token: str | None = TOKEN) -> None:
        """``admin_token``: None starts a loopback server without one (gRPC Reset and external
        corpora then need no token; with one they need it, as REST writes do)."""
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.env = env or {}
        self.admin_token = admin_token
        self.proc: subprocess.Popen | None = None
        self.grpc_port = self.admin_port = 0

    def start(self, grpc_port: int = 0, admin_port: int = 0, timeout: float = 30.0) -> "ServerProcess":
        ports = self.data_dir / "ports.json"
        ports.unlink(missing_ok=True)
        self.log_path = self.data_dir / f"server-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1",
               "--grpc-port", str(grpc_port), "--admin-port", str(admin_port), "--data-dir", str(self.data_dir),
               "--ports-file", str(ports), *(("--admin-token", self.admin_token) if self.admin_token else ()),
               "--drain-timeout-s", "1", *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ports.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server did not start within {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        p = json.loads(ports.read_text())
        self.grpc_port, self.admin_port = p["grpc_port"], p["admin_port"]
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def http(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.admin_url, headers=headers, timeout=30.0)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: drain and snapshot."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._log.close()
        return rc

    def kill(self) -> None:
        """kill -9: no drain, no snapshot."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


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
