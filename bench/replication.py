"""Replication benchmark: corpus replicas (processes on 127.0.0.1) fed by a local nats-server -js.

1. Commit-to-visible lag at rising commit rates with 1, 2 and 4 replicas: one loader process per
   replica commits through a real client Session (64 live requests, extends every 10 ms, requests
   finished and replaced every 1024 tokens) at rate/replicas tokens/s. The lag of a chunk runs from
   the moment the replica that received its tokens cut it (when a single node would queue it for
   its learned corpus) to the moment it is visible to drafts on a replica; p50/p99 over every
   replica's samples.
2. Lookups per core: a closed-loop drafting client (16 requests, budget 15) per server for a fixed
   time, with a 10k tokens/s commit stream running; lookups per CPU-second of the server processes,
   single node (no --log, the same-run baseline) against 1, 2 and 4 replicas.
3. Bootstrap time against snapshot size: a snapshot of a learned corpus of the given size is put in
   the blob store; a new replica is timed from process start to /readyz 200 (and its own snapshot
   load time read from its log); the in-process NgramCorpus.load of the same file is the baseline.

  python3 bench/replication.py                                  # all three parts, default sizes
  python3 bench/replication.py --parts lag --rates 10000 100000 --replicas 1 2
  python3 bench/replication.py --parts bootstrap --snapshot-mb 64 1024
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from corpus_service import NgramCorpus  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NS = "default"
VOCAB = 5000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phrases(seed: int = 0, n: int = 500) -> list[np.ndarray]:
    """A pool of phrases: documents made of them repeat, as real outputs do, so lookups find matches."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(8, 33))).astype(np.int32) for _ in range(n)]


def _doc(rng, pool, n_phrases: int = 64) -> np.ndarray:
    return np.concatenate([pool[i] for i in rng.integers(0, len(pool), n_phrases)])


class Nats:
    def __init__(self, root: Path) -> None:
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        self.port = _free_port()
        self.proc = subprocess.Popen([exe, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(root)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.05)
        self.url = f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Server:
    """``python -m corpus_service serve`` (replicated when ``log`` is given)."""

    def __init__(self, root: Path, log: str | None = None, stream: str = "", blobs: Path | None = None,
                 replica_id: str = "", extra: tuple[str, ...] = ()) -> None:
        root.mkdir(parents=True, exist_ok=True)
        ports = root / "ports.json"
        cmd = [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
               "--admin-port", "0", "--data-dir", str(root), "--ports-file", str(ports), "--worker-threads", "2",
               "--namespace", f"{NS}:vocab={VOCAB},learned_max_bytes=0", "--snapshot-interval-s", "0", *extra]
        if log:
            cmd += ["--log", log, "--log-stream", stream, "--blob-store", str(blobs), "--replica-id", replica_id,
                    "--ready-lag", "0"]
        self.t_start = time.perf_counter()
        self.log_path = root / "server.log"
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not ports.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.02)
        p = json.loads(ports.read_text())
        self.target = f"127.0.0.1:{p['grpc_port']}"
        self.admin = f"http://127.0.0.1:{p['admin_port']}"

    def wait_ready(self, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.admin}/readyz", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(self.log_path.read_text()[-3000:])
            time.sleep(0.01)
        return time.perf_counter() - self.t_start

    def status(self, lags: int = 0) -> dict:
        return httpx.get(f"{self.admin}/v1/replication", params={"lags": lags}, timeout=30).json()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------- load processes (spawned)

def _loader(target: str, rate: float, seconds: float, seed: int, done) -> None:
    """Commits ``rate`` tokens/s through one Session for ``seconds``; puts the tokens sent in ``done``."""
    from corpus_service.client import CorpusClient

    rng, pool = np.random.default_rng(seed), _phrases()
    tick, batch, per_req = 0.01, 64, 1024
    docs = {f"{seed}-{i}": (_doc(rng, pool), 0) for i in range(batch)}
    sent, serial = 0, batch
    with CorpusClient(target, timeout=30) as c:
        for rid, (d, _) in docs.items():
            # Prompts of 1..127 tokens (learned too): the requests' 128-token chunks do not all
            # fall due in the same tick.
            c.start_request(rid, d[:int(rng.integers(1, 128))])
        t0 = time.perf_counter()
        next_t, carry = t0, 0.0
        while time.perf_counter() - t0 < seconds:
            carry += rate * tick
            each = int(carry // batch)
            if each:
                carry -= each * batch
                for rid in list(docs):
                    d, pos = docs[rid]
                    c.extend(rid, d[16 + pos:16 + pos + each] if 16 + pos + each <= d.size else rng.integers(0, VOCAB, each))
                    sent += each
                    if pos + each >= per_req:
                        c.finish(rid)
                        del docs[rid]
                        serial += 1
                        nd = _doc(rng, pool)
                        docs[f"{seed}-{serial}"] = (nd, 0)
                        c.start_request(f"{seed}-{serial}", nd[:16])
                    else:
                        docs[rid] = (d, pos + each)
                c.flush()
            next_t += tick
            time.sleep(max(0.0, next_t - time.perf_counter()))
        for rid in docs:
            c.finish(rid)
        c.flush()
    done.put(sent)


def _drafter(target: str, seconds: float, seed: int, out) -> None:
    from corpus_service.client import CorpusClient

    rng, pool = np.random.default_rng(seed + 1000), _phrases()
    with CorpusClient(target, timeout=30) as c:
        rids = [f"d{seed}-{i}" for i in range(16)]
        for rid in rids:
            c.start_request(rid, _doc(rng, pool, 8))
        c.draft(rids, 15)
        n, nodes, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            nodes += int(c.draft(rids, 15).counts.sum())
            n += len(rids)
        out.put((n, nodes, time.perf_counter() - t0))


def _spawn(fn, *args):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    return p, q


# ---------------------------------------------------------------------- parts

def _cluster(tmp: Path, nats: Nats, n: int, tag: str) -> list[Server]:
    blobs = tmp / f"blobs-{tag}"
    servers = [Server(tmp / f"{tag}-r{i}", nats.url, f"bench-{tag}", blobs, f"r{i}") for i in range(n)]
    for s in servers:
        s.wait_ready()
    return servers


def _wait_caught_up(servers: list[Server], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = [s.status() for s in servers]
        if all(x["buffered_tokens"] == 0 and x["pending"] == 0 for x in st) and len({x["applied_seq"] for x in st}) == 1:
            return
        time.sleep(0.05)
    raise TimeoutError("replicas did not catch up")


def bench_lag(args, tmp: Path, nats: Nats) -> list[dict]:
    rows = []
    for n in args.replicas:
        servers = _cluster(tmp, nats, n, f"lag{n}")
        try:
            for rate in args.rates:
                before = [s.status()["lag_count"] for s in servers]
                procs = [_spawn(_loader, s.target, rate / n, args.seconds, 100 * n + i) for i, s in enumerate(servers)]
                sent = sum(q.get() for _, q in procs)
                for p, _ in procs:
                    p.join()
                _wait_caught_up(servers)
                lags = []
                for s, b in zip(servers, before):
                    st = s.status()
                    lags += s.status(lags=st["lag_count"] - b)["lags_ms"]
                st = servers[0].status()
                row = {"replicas": n, "target_tokens_per_s": rate, "achieved_tokens_per_s": sent / args.seconds,
                       "batches_measured": len(lags), "lag_ms_p50": float(np.percentile(lags, 50)) if lags else None,
                       "lag_ms_p99": float(np.percentile(lags, 99)) if lags else None,
                       "dropped_tokens": st["dropped_tokens"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for s in servers:
                s.stop()
    return rows


def _measure_lookups(servers: list[Server], seconds: float, seed: int) -> tuple[int, float, float, int]:
    cpu0 = [s.cpu_s() for s in servers]
    loads = [_spawn(_loader, s.target, 10_000 / len(servers), seconds, seed + 50 + i) for i, s in enumerate(servers)]
    drafts = [_spawn(_drafter, s.target, seconds, seed + i) for i, s in enumerate(servers)]
    res = [q.get() for _, q in drafts]
    for p, q in loads:
        q.get(), p.join()
    for p, _ in drafts:
        p.join()
    cpu = sum(s.cpu_s() - c for s, c in zip(servers, cpu0))
    return sum(r[0] for r in res), max(r[2] for r in res), cpu, sum(r[1] for r in res)


def bench_lookups(args, tmp: Path, nats: Nats) -> list[dict]:
    """Every configuration stays up and the measurements alternate between them (``--rounds``), so a
    machine shared with other work loads them alike; the median round counts."""
    configs = {0: [Server(tmp / "single")]}  # 0: single node, no broker (the baseline)
    for n in args.replicas:
        configs[n] = _cluster(tmp, nats, n, f"look{n}")
    rounds: dict[int, list[tuple]] = {n: [] for n in configs}
    try:
        for n, servers in configs.items():  # fill each corpus first, so drafts do real work
            fill = [_spawn(_loader, s.target, 50_000 / len(servers), 4.0, 7 + i) for i, s in enumerate(servers)]
            for p, q in fill:
                q.get(), p.join()
            if n:
                _wait_caught_up(servers)
        for r in range(args.rounds):
            for n, servers in configs.items():
                rounds[n].append(_measure_lookups(servers, args.seconds, 100 * r))
    finally:
        for servers in configs.values():
            for s in servers:
                s.stop()
    rows = []
    for n, rs in rounds.items():
        per_cpu = [lk / cpu for lk, _, cpu, _ in rs]
        med = sorted(range(len(rs)), key=lambda i: per_cpu[i])[len(rs) // 2]
        lookups, wall, cpu, nodes = rs[med]
        row = {"replicas": n, "lookups_per_s": lookups / wall, "server_cpu_s": cpu, "lookups_per_cpu_s": lookups / cpu,
               "rounds_lookups_per_cpu_s": per_cpu, "nodes_per_lookup": nodes / max(1, lookups)}
        rows.append(row)
    base = rows[0]["lookups_per_cpu_s"]
    for row in rows:
        row["per_core_vs_single_node"] = row["lookups_per_cpu_s"] / base
        print(json.dumps(row), flush=True)
    return rows


def bench_bootstrap(args, tmp: Path, nats: Nats) -> list[dict]:
    from corpus_service.replication.blobstore import FileBlobStore
    from corpus_service.replication.snapshots import Snapshots
    from corpus_service.service_config import ServiceConfig
    from corpus_service.service_state import ServiceState

    rows = []
    pool, rng = _phrases(), np.random.default_rng(3)
    for mb in args.snapshot_mb:
        tag = f"boot{int(mb)}"
        state = ServiceState(ServiceConfig(admin_port=-1, namespaces=(f"{NS}:vocab={VOCAB},learned_max_bytes=0",),
                                           worker_threads=1))
        corpus = state.corpus(NS)
        target_tokens = int(mb * 2**20 / 6.5)  # ~6.5 B per token on disk (measured below)
        put = 0
        while put < target_tokens:
            docs = [_doc(rng, pool, 256) for _ in range(256)]
            corpus.batch_put(docs)
            put += sum(d.size for d in docs)
        corpus.synchronize()
        blobs = tmp / f"blobs-{tag}"
        rec = Snapshots(FileBlobStore(blobs), "bench").write(state, 0)
        path = blobs / rec.namespaces[NS]
        t0 = time.perf_counter()
        loaded = NgramCorpus(corpus.config)
        loaded.load(path)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded.check_integrity()  # the walk load ends with, timed alone: where a load's time goes
        integrity_s = time.perf_counter() - t0
        del loaded
        state.close()
        del corpus, state
        s = Server(tmp / tag, nats.url, f"bench-{tag}", blobs, "boot")
        try:
            ready_s = s.wait_ready()
            m = re.search(r"loaded snapshot at seq \d+ \((\d+) bytes\) in ([\d.]+)s", s.log_path.read_text())
        finally:
            s.stop()
        row = {"snapshot_mb": rec.bytes / 2**20, "tokens": put, "process_to_ready_s": ready_s,
               "replica_load_s": float(m.group(2)) if m else None, "inprocess_load_s": load_s,
               "inprocess_check_integrity_s": integrity_s,
               "ready_vs_inprocess_load": ready_s / load_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(blobs, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["lag", "lookups", "bootstrap"], choices=["lag", "lookups", "bootstrap"])
    ap.add_argument("--rates", type=float, nargs="+", default=[10_000, 30_000, 100_000], help="committed tokens/s")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="lookup measurements per configuration (median)")
    ap.add_argument("--snapshot-mb", type=float, nargs="+", default=[16, 64, 256])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replication.json")
    args = ap.parse_args()
    result = {"cpus": os.cpu_count(), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-repl-") as tmp:
        nats = Nats(Path(tmp) / "nats")
        try:
            if "lag" in args.parts:
                result["lag"] = bench_lag(args, Path(tmp), nats)
            if "lookups" in args.parts:
                result["lookups"] = bench_lookups(args, Path(tmp), nats)
            if "bootstrap" in args.parts:
                result["bootstrap"] = bench_bootstrap(args, Path(tmp), nats)
        finally:
            nats.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    parts = []
    if result.get("lag"):
        worst = max(result["lag"], key=lambda r: (r["target_tokens_per_s"], r["replicas"]))
        parts.append(f"lag p99 {worst['lag_ms_p99']:.1f} ms at {worst['achieved_tokens_per_s']:.0f} tok/s x{worst['replicas']} replicas")
    if result.get("lookups"):
        r1 = next((r for r in result["lookups"] if r["replicas"] == 1), None)
        if r1:
            parts.append(f"lookups/core replicated {r1['per_core_vs_single_node']:.2f}x single node")
    if result.get("bootstrap"):
        b = result["bootstrap"][-1]
        parts.append(f"{b['snapshot_mb']:.0f} MB snapshot ready in {b['process_to_ready_s']:.1f} s "
                     f"({b['ready_vs_inprocess_load']:.2f}x in-process load)")
    print("replication: " + "; ".join(parts) + f"  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
