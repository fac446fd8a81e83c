"""Load: N clients for T seconds of mixed draft / commit / upload traffic against one corpus server
on loopback. Reports latency percentiles per operation, the error count (the promise is zero), and
the server's peak resident memory against the configured learned-corpus bound.

Each client thread mixes, by weight:
- ``draft``: one decode step of a batch of live requests over its Session stream (extend with the
  tokens "accepted" last step, draft a tree per request), starting and finishing requests as they end;
- ``commit``: ``BatchPut`` of finished sequences into the learned corpus (the SGLang path), then
  ``synchronize`` (the server applied it);
- ``upload``: a small external corpus through the REST admin (202 = durable), deleted again later.
The learned-corpus bound (``--learned-max-bytes``) is set well below what the run commits, so FIFO
eviction runs throughout. Baseline (same run): one client alone, before the load.

    python3 bench/load.py                                  # 4 clients x 20 s
    python3 bench/load.py --clients 8 --seconds 60 --learned-max-bytes 16777216
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import CorpusServer, percentiles, persistent_server, write_report  # noqa: E402
from corpus_service.client import CorpusClient, RemoteNgramCorpus  # noqa: E402
from tests.corpus_service.server_health import rss_bytes  # noqa: E402

VOCAB = 32000
OPS = ("draft", "commit", "upload")


class Texts:
    """Token sequences with the repetition drafting feeds on: variants of a pool of base texts."""

    def __init__(self, seed: int, pool: int = 64, length: int = 400) -> None:
        rng = np.random.default_rng(seed)
        self.base = [rng.integers(0, VOCAB, length).astype(np.int32) for _ in range(pool)]

    def sample(self, rng: random.Random, n: int) -> np.ndarray:
        b = self.base[rng.randrange(len(self.base))]
        i = rng.randrange(len(b) - n)
        seq = b[i : i + n].copy()
        for _ in range(max(1, n // 20)):  # a few substitutions: not every continuation is known
            seq[rng.randrange(n)] = rng.randrange(VOCAB)
        return seq


class Client(threading.Thread):
    def __init__(self, idx: int, srv: CorpusServer, texts: Texts, seconds: float, weights: dict[str, float],
                 batch: int, budget: int) -> None:
        super().__init__(daemon=True, name=f"load-client-{idx}")
        self.idx, self.srv, self.texts, self.seconds, self.weights = idx, srv, texts, seconds, weights
        self.batch, self.budget = batch, budget
        self.rng = random.Random(idx)
        self.lat: dict[str, list[float]] = {op: [] for op in OPS}
        self.errors: list[str] = []
        self.tokens_committed = 0

    def run(self) -> None:
        with CorpusClient(self.srv.target, timeout=30.0) as client, self.srv.http() as http:
            remote = RemoteNgramCorpus(self.srv.target, timeout=30.0)
            live: dict[str, tuple[np.ndarray, int]] = {}  # req id -> (its text, tokens committed so far)
            uploads: list[str] = []
            ops, w = list(self.weights), list(self.weights.values())
            n = 0
            end = time.monotonic() + self.seconds
            try:
                while time.monotonic() < end:
                    op = self.rng.choices(ops, w)[0]
                    n += 1
                    t0 = time.perf_counter()
                    try:
                        if op == "draft":
                            self._step(client, live, n)
                        elif op == "commit":
                            seqs = [self.texts.sample(self.rng, 64) for _ in range(8)]
                            remote.batch_put(seqs)
                            remote.synchronize()  # acknowledged: applied to the learned corpus
                            self.tokens_committed += sum(len(s) for s in seqs)
                        else:
                            self._upload(http, uploads, n)
                    except Exception as e:  # noqa: BLE001 - counted: the promise is zero
                        self.errors.append(f"{op}: {type(e).__name__}: {e}"[:300])
                        continue
                    self.lat[op].append(time.perf_counter() - t0)
            finally:
                remote.close()

    def _step(self, client: CorpusClient, live: dict, n: int) -> None:
        while len(live) < self.batch:
            rid = f"c{self.idx}r{n}-{len(live)}"
            text = self.texts.sample(self.rng, 256)
            client.start_request(rid, text[:32])
            live[rid] = (text, 32)
        for rid, (text, done) in list(live.items()):
            step = self.rng.randint(1, 4)  # accepted draft tokens + the bonus token
            client.extend(rid, text[done : done + step])
            self.tokens_committed += step
            if done + step >= len(text) - 4:
                client.finish(rid)
                del live[rid]
            else:
                live[rid] = (text, done + step)
        if live:
            client.draft(list(live), self.budget)

    def _upload(self, http, uploads: list[str], n: int) -> None:
        name = f"c{self.idx}u{n}"
        body = "".join(json.dumps({"ids": self.texts.sample(self.rng, 200).tolist()}) + "\n" for _ in range(4))
        r = http.put(f"/v1/namespaces/default/corpora/{name}", params={"format": "jsonl"}, content=body)
        if r.status_code != 202:
            raise RuntimeError(f"upload {r.status_code}: {r.text[:200]}")
        uploads.append(name)
        if len(uploads) > 4:  # keep a few: the external corpora stay small, deletes are load too
            old = uploads.pop(0)
            r = http.delete(f"/v1/namespaces/default/corpora/{old}")
            if r.status_code not in (204, 404):
                raise RuntimeError(f"delete {r.status_code}: {r.text[:200]}")


def run_clients(srv, texts, clients: int, seconds: float, weights, batch: int, budget: int) -> list[Client]:
    threads = [Client(i, srv, texts, seconds, weights, batch, budget) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--baseline-seconds", type=float, default=5.0, help="one client alone first (same run)")
    ap.add_argument("--batch", type=int, default=8, help="live requests per client session")
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--weights", default="draft=8,commit=2,upload=0.2", help="op=weight,...")
    ap.add_argument("--learned-max-bytes", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "load.json")
    args = ap.parse_args()
    weights = {k: float(v) for k, v in (kv.split("=") for kv in args.weights.split(","))}
    if set(weights) - set(OPS):
        ap.error(f"--weights: ops are {', '.join(OPS)}")
    texts = Texts(args.seed)
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        srv = persistent_server(Path(tmp), "--namespace", f"default:vocab={VOCAB},learned_max_bytes={args.learned_max_bytes}",
                            "--snapshot-interval-s", "5").start()
        try:
            rss0 = rss_bytes(srv.proc.pid)
            base = run_clients(srv, texts, 1, args.baseline_seconds, {"draft": 1.0}, args.batch, args.budget)
            peak = [rss_bytes(srv.proc.pid)]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.05):
                    peak[0] = max(peak[0], rss_bytes(srv.proc.pid))

            monitor = threading.Thread(target=sample, daemon=True)
            monitor.start()
            t0 = time.monotonic()
            threads = run_clients(srv, texts, args.clients, args.seconds, weights, args.batch, args.budget)
            wall = time.monotonic() - t0
            stop.set()
            monitor.join()
            with srv.http() as http:
                stats = http.get("/v1/stats").json()["default"]
                integrity = http.get("/v1/integrity").json()
            alive = srv.alive()
        finally:
            srv.stop()
    def ms(xs: list[float]) -> dict:  # seconds in, ms out, with the 99.9th percentile (the tail the promise is about)
        return percentiles(xs, "ms", scale=1e3, qs=(50, 99, 99.9), digits=3)

    lat = {op: ms([x for t in threads for x in t.lat[op]]) for op in OPS}
    base_draft = ms(base[0].lat["draft"])
    errors = [e for t in threads + base for e in t.errors]
    out = {
        "clients": args.clients, "seconds": args.seconds, "batch": args.batch, "budget": args.budget, "weights": weights,
        "latency": lat, "baseline_one_client_draft": base_draft,
        "draft_p50_ratio_vs_one_client": round(lat["draft"]["p50_ms"] / base_draft["p50_ms"], 2) if lat["draft"]["n"] else None,
        "errors": len(errors), "error_samples": errors[:10], "ops_per_s": round(sum(v["n"] for v in lat.values()) / wall, 1),
        "tokens_committed": sum(t.tokens_committed for t in threads),
        "learned_max_bytes": args.learned_max_bytes, "learned_bytes_end": stats["learned_bytes"],
        "server_rss_start_mib": round(rss0 / 2**20, 1), "server_rss_peak_mib": round(peak[0] / 2**20, 1),
        "integrity": integrity, "server_alive": alive,
    }
    summary = {"clients": args.clients, "seconds": args.seconds, "ops_per_s": out["ops_per_s"], "errors": len(errors),
               **{f"{op}_{k}": lat[op].get(k) for op in OPS for k in ("p50_ms", "p99_ms", "p999_ms")},
               "draft_p50_ratio_vs_one_client": out["draft_p50_ratio_vs_one_client"],
               "learned_mib_end": round(stats["learned_bytes"] / 2**20, 1),
               "learned_mib_bound": round(args.learned_max_bytes / 2**20, 1),
               "server_rss_start_mib": out["server_rss_start_mib"], "server_rss_peak_mib": out["server_rss_peak_mib"],
               "integrity_ok": bool(integrity["ok"]), "server_alive": alive}
    write_report(args.out, out, summary)
    sys.exit(1 if errors or not integrity["ok"] or not alive else 0)


if __name__ == "__main__":
    main()
