"""What security costs a client: decode-step and unary latency against three corpus servers on
127.0.0.1, started side by side and measured in interleaved rounds (the same-run baseline):
``plain`` (no tokens, no TLS: the default), ``tokens`` (--client-tokens: the auth interceptor and a
namespace check per call and step) and ``tokens+tls`` (the same over TLS, certificates generated
at start).

A step is what a verifier sends each decode step: B requests each extended by a few tokens, and a
budget-15 draft for all of them. Unary is ``Stats`` of one namespace (a small message: the fixed
cost of a call). Prints one line; JSON under bench/results/security.json.

  python bench/security.py                      # B=16, 300 steps and 300 unary calls per server
  python bench/security.py --batch 64 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corpus_service.client import CorpusClient  # noqa: E402
from tests.corpus_service.certs import make_certs  # noqa: E402 - test-time certificates (cryptography)

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-security-token-0123456789"


def start(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, int]:
    ports = tmp / f"{name}.ports.json"
    proc = subprocess.Popen([sys.executable, "-m", "corpus_service", "serve", "--grpc-port", "0", "--admin-port", "-1",
                             "--ports-file", str(ports), "--log-level", "WARNING", *extra], cwd=REPO)
    deadline = time.monotonic() + 60
    while not ports.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {name} server did not start")
        time.sleep(0.05)
    return proc, json.loads(ports.read_text())["grpc_port"]


def summarize(us: list[float]) -> dict:
    a = np.asarray(us)
    return {"n": int(a.size), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300, help="decode steps (and unary calls) per server")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds the steps are split into")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "security.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        certs = make_certs(tmp / "certs")
        (tmp / "tokens.json").write_text(json.dumps(
            {"clients": [{"name": "bench", "token": TOKEN, "namespaces": ["default"], "role": "draft"}]}))
        tokens = ("--client-tokens", str(tmp / "tokens.json"))
        servers = {"plain": start(tmp, "plain"), "tokens": start(tmp, "tokens", *tokens),
                   "tokens+tls": start(tmp, "tls", *tokens, "--tls-cert", certs.server_cert, "--tls-key", certs.server_key)}
        clients = {"plain": CorpusClient(f"127.0.0.1:{servers['plain'][1]}", timeout=30, tls=False, token=""),
                   "tokens": CorpusClient(f"127.0.0.1:{servers['tokens'][1]}", timeout=30, tls=False, token=TOKEN),
                   "tokens+tls": CorpusClient(f"127.0.0.1:{servers['tokens+tls'][1]}", timeout=30, tls=certs.ca, token=TOKEN)}
        step_us = {k: [] for k in clients}
        unary_us = {k: [] for k in clients}
        try:
            rids = [f"r{i}" for i in range(args.batch)]
            for c in clients.values():
                for rid in rids:
                    c.start_request(rid, rng.integers(0, 1000, 256).tolist())
                for _ in range(5):  # warm-up: connections, sessions, TLS handshakes
                    c.draft(rids, args.budget)
                    c.stats()
            per_round = max(1, args.steps // args.rounds)
            for _ in range(args.rounds):
                for name, c in clients.items():
                    for _ in range(per_round):
                        for rid in rids:
                            c.extend(rid, rng.integers(0, 1000, 3).tolist())
                        t0 = time.perf_counter()
                        c.draft(rids, args.budget)
                        step_us[name].append((time.perf_counter() - t0) * 1e6)
                    for _ in range(per_round):
                        t0 = time.perf_counter()
                        c.stats()
                        unary_us[name].append((time.perf_counter() - t0) * 1e6)
        finally:
            for c in clients.values():
                c.close()
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    rows = {k: {"step": summarize(step_us[k]), "unary_stats": summarize(unary_us[k])} for k in clients}
    base = rows["plain"]
    for k, r in rows.items():
        r["step_p50_over_plain"] = r["step"]["p50_us"] / base["step"]["p50_us"]
        r["unary_p50_over_plain"] = r["unary_stats"]["p50_us"] / base["unary_stats"]["p50_us"]
    result = {"rows": rows, "config": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    parts = [f"{k} step p50 {r['step']['p50_us']:.0f} us ({r['step_p50_over_plain']:.2f}x), "
             f"unary p50 {r['unary_stats']['p50_us']:.0f} us ({r['unary_p50_over_plain']:.2f}x)" for k, r in rows.items()]
    print(f"security: B={args.batch} budget {args.budget}: " + "; ".join(parts)
          + f"; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
