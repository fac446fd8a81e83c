"""What security costs a client: decode-step and unary latency against three corpus servers on
127.0.0.1, started side by side and measured in interleaved rounds (the same-run baseline):
``plain`` (no tokens, no TLS: the default), ``tokens`` (--client-tokens: the auth interceptor and a
namespace check per call and step) and ``tokens+tls`` (the same over TLS, certificates generated
at start).

A step is what a verifier sends each decode step: B requests each extended by a few tokens, and a
budget-15 draft for all of them. Unary is ``Stats`` of one namespace (a small message: the fixed
cost of a call). Prints one summary line; JSON under bench/results/security.json.

  python bench/security.py                      # B=16, 300 steps and 300 unary calls per server
  python bench/security.py --batch 64 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CorpusServer, load_average, percentiles, write_report  # noqa: E402
from corpus_service.client import CorpusClient  # noqa: E402
from tests.corpus_service.certs import make_certs  # noqa: E402 - test-time certificates (cryptography)

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-security-token-0123456789"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300, help="decode steps (and unary calls) per server")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds the steps are split into")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "security.json")
    args = ap.parse_args()
    load_before = load_average()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        certs = make_certs(tmp / "certs")
        (tmp / "tokens.json").write_text(json.dumps(
            {"clients": [{"name": "bench", "token": TOKEN, "namespaces": ["default"], "role": "draft"}]}))
        tokens = ("--client-tokens", str(tmp / "tokens.json"))
        servers = {"plain": CorpusServer(tmp / "plain").start(), "tokens": CorpusServer(tmp / "tokens", *tokens).start(),
                   "tokens+tls": CorpusServer(tmp / "tls", *tokens, "--tls-cert", certs.server_cert,
                                              "--tls-key", certs.server_key).start()}
        clients = {"plain": CorpusClient(servers["plain"].target, timeout=30, tls=False, token=""),
                   "tokens": CorpusClient(servers["tokens"].target, timeout=30, tls=False, token=TOKEN),
                   "tokens+tls": CorpusClient(servers["tokens+tls"].target, timeout=30, tls=certs.ca, token=TOKEN)}
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
            for srv in servers.values():
                srv.stop()
    rows = {k: {"step": percentiles(step_us[k]), "unary_stats": percentiles(unary_us[k])} for k in clients}
    base = rows["plain"]
    for k, r in rows.items():
        r["step_p50_over_plain"] = r["step"]["p50_us"] / base["step"]["p50_us"]
        r["unary_p50_over_plain"] = r["unary_stats"]["p50_us"] / base["unary_stats"]["p50_us"]
    result = {"rows": rows, "config": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_average()}}
    summary = {"batch": args.batch, "budget": args.budget}
    for k, r in rows.items():
        summary.update({f"{k}_step_p50_us": r["step"]["p50_us"], f"{k}_step_p50_over_plain": round(r["step_p50_over_plain"], 3),
                        f"{k}_unary_p50_us": r["unary_stats"]["p50_us"],
                        f"{k}_unary_p50_over_plain": round(r["unary_p50_over_plain"], 3)})
    summary.update({"load_average": [load_before[0], result["machine"]["loadavg_after"][0]], "cpus": os.cpu_count()})
    write_report(args.out, result, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
