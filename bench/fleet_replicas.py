"""The fleet benchmark's processes (``bench/rollouts.py fleet``): a server process read back through
its ports file, the corpus service, the verifier replicas' command line (epoch 0's policy, the admin
routes on), waiting until they are healthy, and what is posted to all replicas at once: a new
policy, a policy version."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Proc:
    """A server process with its port read back from a ports file."""

    def __init__(self, cmd: list[str], ports_file: Path, log_path: Path, env: dict | None = None) -> None:
        self.ports_file = ports_file
        self.log_path = log_path
        ports_file.unlink(missing_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def ports(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ports_file.exists() or not self.ports_file.read_text().strip():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.proc.args[:4]} did not start within {timeout} s:\n{self.tail()}")
            time.sleep(0.1)
        time.sleep(0.05)  # the file is written whole; a partial read retries below
        try:
            return json.loads(self.ports_file.read_text())
        except json.JSONDecodeError:
            time.sleep(0.5)
            return json.loads(self.ports_file.read_text())

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_corpus(work: Path, token: str, namespace: str) -> tuple[Proc, str]:
    data = work / "corpus"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
           "--admin-port", "0", "--data-dir", str(data), "--ports-file", str(work / "corpus-ports.json"),
           "--admin-token", token, "--namespace", namespace]
    p = Proc(cmd, work / "corpus-ports.json", work / "corpus.log")
    ports = p.ports(60)
    return p, f"127.0.0.1:{ports['grpc_port']}"


def verifier_cmd(args: argparse.Namespace, corpus: str, ports_file: Path, token: str) -> list[str]:
    """A replica with epoch 0's policy; later epochs' weights come through POST /v1/update-weights."""
    cmd = [sys.executable, "-m", "verifier", "serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--port", "0", "--ports-file", str(ports_file), "--corpus", corpus,
           "--max-batch", str(args.max_batch), "--max-len", str(args.max_len), "--max-budget", str(args.budget),
           "--allow-weight-updates", "true", "--allow-policy-version", "true", "--admin-key", VERIFIER_ADMIN_KEY]
    if corpus not in ("local", "none"):
        cmd += ["--corpus-token", token]
    if args.device.startswith("cuda"):
        # The replicas share the one GPU: a tree's extra forward time delays all of them (verifier
        # --gpu-share; docs/rollouts.md). A --verifier-arg=--gpu-share=N overrides it.
        cmd += ["--gpu-share", str(args.replicas)]
    if args.noise_sigma > 0:
        cmd += ["--weight-noise-sigma", repr(args.noise_sigma), "--weight-noise-seed", str(noise_seed(args, 0))]
    return cmd + list(args.verifier_arg)  # last: they override the above


# The replicas' admin credential: /v1/update-weights and /v1/policy-version answer only it (verifier/api/admin.py).
VERIFIER_ADMIN_KEY = "rollouts-bench-verifier-admin-key"


def noise_seed(args: argparse.Namespace, epoch: int) -> int:
    return args.noise_seed_base + args.noise_seed_stride * epoch


async def new_policy(urls: list[str], args: argparse.Namespace, epoch: int, announce: bool) -> float:
    """Epoch ``epoch``'s weights into every replica at once (each drains its requests, none run between
    epochs) and, with ``announce``, its policy version to their corpora; returns the seconds it took."""
    body: dict = {"weight_noise_sigma": args.noise_sigma, "weight_noise_seed": noise_seed(args, epoch)}
    if announce:
        body["policy_version"] = epoch
    return await post_all(urls, "/v1/update-weights", body, args.start_timeout_s)


async def post_all(urls: list[str], route: str, body: dict, timeout: float) -> float:
    """``body`` to ``route`` of every replica at once; RuntimeError unless all answer 200; the seconds."""
    import httpx

    t = time.perf_counter()
    admin = {"Authorization": f"Bearer {VERIFIER_ADMIN_KEY}"}  # (both routes it posts to are admin routes)
    async with httpx.AsyncClient(timeout=timeout) as http:
        rs = await asyncio.gather(*(http.post(u + route, json=body, headers=admin) for u in urls))
    for u, r in zip(urls, rs):
        if r.status_code != 200:
            raise RuntimeError(f"{u}{route}: HTTP {r.status_code}: {r.text[:500]}")
    return time.perf_counter() - t


async def announce_version(urls: list[str], epoch: int) -> float:
    """``POST /v1/policy-version`` on every replica (their corpora: one service, or each its own)."""
    return await post_all(urls, "/v1/policy-version", {"version": epoch}, 60.0)


def wait_healthy(urls: list[str], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                if httpx.get(u + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{u}/healthz not ready within {timeout} s")
            time.sleep(0.2)
