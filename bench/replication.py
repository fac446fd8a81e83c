"""Replication benchmark: corpus replicas (processes on 127.0.0.1) fed by a local nats-server -js,
with snapshots on (every ``--snapshot-interval-s``, jittered, written by a forked child).

1. lag: commit-to-visible lag at rising commit rates with 1, 2 and 4 replicas: one loader process
   per replica commits through a real client Session (64 live requests, extends every 10 ms,
   requests finished and replaced every 1024 tokens) at rate/replicas tokens/s. The lag of a chunk
   runs from the moment the replica that received its tokens cut it (when a single node would queue
   it for its learned corpus) to the moment it is visible to drafts on a replica; p50/p99 over every
   replica's samples, snapshots included (how many were written is reported).
2. lookups: lookups per core: a closed-loop drafting client (16 requests, budget 15) per server for a
   fixed time, with a 10k tokens/s commit stream running; lookups per CPU-second of the server
   processes, single node (no broker, the same-run baseline) against 1, 2 and 4 replicas.
3. snapshot: a learned corpus of the given size is built in this process and saved (the in-process
   save and load are the baselines); a new replica is timed from process start to /readyz 200 on that
   snapshot (restore to ready); then, with a commit stream running into it, the replica writes a
   snapshot of that size (POST /v1/snapshot) and the commit-to-visible lags of the batches applied
   while it was written are compared with the in-process save time (what applying would have waited
   for, had the snapshot been written under the applier's lock).

  python3 bench/replication.py                                   # all three parts, default sizes
  python3 bench/replication.py --nats-server /path/to/nats-server --parts lag --rates 100000 --replicas 2 4
  python3 bench/replication.py --parts snapshot --snapshot-mb 1024
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

from bench.common import CorpusServer, percentiles, write_report  # noqa: E402
from corpus_service import NgramCorpus  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NS = "default"
VOCAB = 5000
TOKEN = "bench-replication-admin-token"


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


def find_nats_server(given: str | None) -> str:
    exe = given or shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if Path(p).is_file()), None)
    if not exe or not Path(exe).is_file() or not os.access(exe, os.X_OK):
        raise SystemExit(f"bench/replication.py: no nats-server executable ({given or 'not on PATH'}); "
                         "pass --nats-server PATH (a nats-server 2.9+ binary) or apt-get install nats-server")
    return exe


class Nats:
    def __init__(self, root: Path, exe: str) -> None:
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


class Server(CorpusServer):
    """``python -m corpus_service serve`` (replicated when ``log`` is given), started at once."""

    def __init__(self, root: Path, log: str | None = None, stream: str = "", blobs: Path | None = None,
                 replica_id: str = "", extra: tuple[str, ...] = (), snapshot_interval_s: float = 0.0) -> None:
        args = ["--worker-threads", "2", "--namespace", f"{NS}:vocab={VOCAB},learned_max_bytes=0",
                "--snapshot-interval-s", str(snapshot_interval_s if log else 0), *extra]
        if log:
            args += ["--nats-url", log, "--log-stream", stream, "--blob-store", str(blobs), "--replica-id", replica_id,
                     "--ready-lag", "0"]
        # The server's own log level: the restore figures are read from its INFO lines.
        super().__init__(root, *args, persist=True, admin=True, admin_token=TOKEN, log_level=None)
        self.t_start = time.perf_counter()
        self.start(timeout=120)

    def wait_ready(self, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.admin_url}/readyz", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(self.log_path.read_text()[-3000:])
            time.sleep(0.01)
        return time.perf_counter() - self.t_start

    def status(self, lags: int = 0) -> dict:
        return httpx.get(f"{self.admin_url}/v1/replication", params={"lags": lags}, timeout=30).json()

    def snapshot(self) -> float:
        """POST /v1/snapshot (answers once written); seconds it took."""
        t0 = time.perf_counter()
        r = httpx.post(f"{self.admin_url}/v1/snapshot", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    extra = ("--log-batch-ms", str(ARGS.log_batch_ms)) if ARGS.log_batch_ms else ()
    servers = [Server(tmp / f"{tag}-r{i}", nats.url, f"bench-{tag}", blobs, f"r{i}", extra=extra,
                      snapshot_interval_s=ARGS.snapshot_interval_s) for i in range(n)]
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
                snaps0 = sum(s.status()["snapshots_written"] for s in servers)
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
                lag = percentiles(lags, "ms", digits=None)
                row = {"replicas": n, "target_tokens_per_s": rate, "achieved_tokens_per_s": sent / args.seconds,
                       "batches_measured": len(lags), "lag_ms_p50": lag.get("p50_ms"), "lag_ms_p99": lag.get("p99_ms"),
                       "dropped_tokens": sum(s.status()["dropped_tokens"] for s in servers),
                       "snapshots_written": sum(s.status()["snapshots_written"] for s in servers) - snaps0,
                       "snapshot_pause_ms_max": max(s.status()["snapshot_pause_ms"] for s in servers)}
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


def _build_snapshot(mb: float, blobs: Path) -> dict:
    """A learned corpus of about ``mb`` MB built here and written to ``blobs`` as a snapshot every
    replica may start from (stream position 0, no incarnation); the in-process save and load of the
    same corpus are timed as baselines."""
    from corpus_service.replication.blobstore import FileBlobStore
    from corpus_service.replication.snapshots import Snapshots
    from corpus_service.server.config import ServiceConfig
    from corpus_service.server.state import ServiceState

    state = ServiceState(ServiceConfig(admin_port=-1, namespaces=(f"{NS}:vocab={VOCAB},learned_max_bytes=0",),
                                       worker_threads=1))
    corpus = state.corpus(NS)
    pool, rng = _phrases(), np.random.default_rng(3)
    put = 0
    while True:  # until the index holds ~mb (a snapshot is about the index' size; the file is measured)
        docs = [_doc(rng, pool, 256) for _ in range(256)]
        corpus.batch_put(docs)
        put += sum(d.size for d in docs)
        corpus.synchronize()
        if corpus.stats()["learned_bytes"] >= mb * 2**20:
            break
    t0 = time.perf_counter()
    corpus.save(blobs.parent / "inline.ngc")  # what an inline snapshot would hold the applier for
    save_s = time.perf_counter() - t0
    rec = Snapshots(FileBlobStore(blobs), "bench").write(state, 0)
    state.close()
    del corpus, state
    loaded = NgramCorpus(vocab_size=VOCAB, learned_max_bytes=0)
    t0 = time.perf_counter()
    loaded.load(blobs / rec.namespaces[NS])
    load_s = time.perf_counter() - t0
    del loaded
    (blobs.parent / "inline.ngc").unlink()
    return {"snapshot_mb": rec.bytes / 2**20, "tokens": put, "inprocess_save_s": save_s, "inprocess_load_s": load_s}


def bench_snapshot(args, tmp: Path, nats: Nats) -> list[dict]:
    rows = []
    for mb in args.snapshot_mb:
        tag = f"snap{int(mb)}"
        blobs = tmp / tag / "blobs"
        blobs.mkdir(parents=True)
        row = _build_snapshot(mb, blobs)
        s = Server(tmp / tag / "r", nats.url, f"bench-{tag}", blobs, "r")  # timed from process start
        try:
            row["process_to_ready_s"] = s.wait_ready()
            m = re.search(r"loaded snapshot at seq \d+ \((\d+) bytes\) in ([\d.]+)s", s.log_path.read_text())
            row["replica_load_s"] = float(m.group(2)) if m else None
            # A commit stream into the replica while it writes a snapshot of the same size.
            load, q = _spawn(_loader, s.target, args.snapshot_rate, args.seconds + 60, 11)
            time.sleep(2.0)
            c0 = s.status()["lag_count"]
            row["snapshot_request_s"] = s.snapshot()
            st = s.status()
            during = s.status(lags=st["lag_count"] - c0)["lags_ms"]
            time.sleep(2.0)
            c1 = s.status()["lag_count"]
            time.sleep(2.0)
            after = s.status(lags=s.status()["lag_count"] - c1)["lags_ms"]
            load.terminate()
            load.join()
            row.update({"snapshot_written_mb": st["snapshot_bytes"] / 2**20, "snapshot_duration_s": st["snapshot_duration_s"],
                        "snapshot_pause_ms": st["snapshot_pause_ms"], "commit_rate": args.snapshot_rate,
                        "batches_during_snapshot": len(during),
                        "lag_ms_p99_during_snapshot": percentiles(during, "ms", digits=None).get("p99_ms"),
                        "lag_ms_max_during_snapshot": max(during) if during else None,
                        "lag_ms_p99_after": percentiles(after, "ms", digits=None).get("p99_ms"),
                        "dropped_tokens": st["dropped_tokens"]})
            # Ratios to same-run baselines: the worst lag while writing against what an inline save
            # would have stalled applying for; the restore against an in-process load.
            row["max_lag_during_vs_inline_save"] = (row["lag_ms_max_during_snapshot"] or 0) / 1e3 / row["inprocess_save_s"]
            row["ready_vs_inprocess_load"] = row["process_to_ready_s"] / row["inprocess_load_s"]
        finally:
            s.stop()
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(tmp / tag, ignore_errors=True)
    return rows


def _summary(result: dict) -> dict:
    out = {"cpus": result["cpus"]}
    for r in result.get("lag", []):
        out[f"lag_p99_ms_{int(r['target_tokens_per_s'] / 1000)}k_x{r['replicas']}"] = r["lag_ms_p99"]
    if result.get("lag"):
        out["lag_snapshots_written"] = sum(r["snapshots_written"] for r in result["lag"])
        out["lag_dropped_tokens"] = sum(r["dropped_tokens"] for r in result["lag"])
    for r in result.get("lookups", []):
        if r["replicas"]:
            out[f"lookups_per_core_x{r['replicas']}_vs_single_node"] = r["per_core_vs_single_node"]
    for r in result.get("snapshot", []):
        mb = f"{r['snapshot_mb']:.0f}mb"
        out[f"snapshot_{mb}_ready_s"] = r["process_to_ready_s"]
        out[f"snapshot_{mb}_ready_vs_inprocess_load"] = r["ready_vs_inprocess_load"]
        out[f"snapshot_{mb}_pause_ms"] = r["snapshot_pause_ms"]
        out[f"snapshot_{mb}_max_lag_during_vs_inline_save"] = r["max_lag_during_vs_inline_save"]
    return out


ARGS = argparse.Namespace(snapshot_interval_s=5.0, log_batch_ms=None)


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["lag", "lookups", "snapshot"], choices=["lag", "lookups", "snapshot"])
    ap.add_argument("--nats-server", help="path of the nats-server binary (default: on PATH, /usr/sbin, /usr/bin)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10_000, 30_000, 100_000], help="committed tokens/s")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    ap.add_argument("--snapshot-interval-s", type=float, default=5.0,
                    help="replicas' snapshot interval in the lag and lookups parts (0 = snapshots off)")
    ap.add_argument("--log-batch-ms", type=float, default=None,
                    help="replicas' --log-batch-ms in the lag and lookups parts (default: the server's)")
    ap.add_argument("--rounds", type=int, default=3, help="lookup measurements per configuration (median)")
    ap.add_argument("--snapshot-mb", type=float, nargs="+", default=[64, 256, 1024], help="snapshot sizes (MB)")
    ap.add_argument("--snapshot-rate", type=float, default=50_000, help="tokens/s committed while a snapshot is written")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replication.json")
    args = ARGS = ap.parse_args()
    exe = find_nats_server(args.nats_server)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "nats_server": version,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-repl-") as tmp:
        nats = Nats(Path(tmp) / "nats", exe)
        try:
            if "lag" in args.parts:
                result["lag"] = bench_lag(args, Path(tmp), nats)
            if "lookups" in args.parts:
                result["lookups"] = bench_lookups(args, Path(tmp), nats)
            if "snapshot" in args.parts:
                result["snapshot"] = bench_snapshot(args, Path(tmp), nats)
        finally:
            nats.stop()
    result["summary"] = _summary(result)
    write_report(args.out, result, result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
