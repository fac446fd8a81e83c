"""Crash-safety soak: kill -9 the corpus server at random moments during uploads, commits and
snapshots, restart it, and check that nothing acknowledged was lost and nothing corrupt was taken.

One trial: start ``python -m corpus_service serve --data-dir D`` (the same D every trial, so every
acknowledgement of every earlier trial is checked again), run a workload thread (REST uploads,
REST deletes, gRPC commits to the learned corpus, gRPC external-corpus loads, explicit and periodic
snapshots), ``kill -9`` after a random delay, restart, and check:
- every acknowledged upload (202) is listed, ready, with its token count, and drafts continue it;
- every acknowledged delete (204) stays deleted;
- everything committed over gRPC before an acknowledged snapshot (200) began drafts again;
- ``GET /v1/integrity`` holds, no snapshot was refused, no partial upload is left on disk.
Every ``--corrupt-every`` trials the snapshot is then damaged (truncated, or one byte flipped) and
the server restarted once more: it must refuse the file, move it aside, report it
(``GET /v1/namespaces/NS``), and still rebuild every acknowledged upload from its file.

    python3 bench/crash_soak.py                  # 50 trials; one summary line; bench/results/crash_soak.json
    python3 bench/crash_soak.py --trials 3 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import ADMIN_TOKEN as TOKEN, CorpusServer, persistent_server, write_report  # noqa: E402
from corpus_service.client import CorpusClient, RemoteNgramCorpus  # noqa: E402

NS = "default"
PROBE = 8  # context tokens of a draft probe
CHECK = 4  # tokens a probe must continue with


@dataclass
class Expected:
    """What the server acknowledged, across every trial."""

    uploads: dict[str, list[int]] = field(default_factory=dict)  # 202, not deleted
    deleted: set[str] = field(default_factory=set)  # 204
    durable: dict[str, list[int]] = field(default_factory=dict)  # gRPC commits/loads covered by a 200 snapshot
    maybe: dict[str, list[int]] = field(default_factory=dict)  # sent, fate unknown (the kill came first)


@dataclass
class TrialResult:
    trial: int
    kill_after_s: float
    ops: dict[str, int]
    restart_s: float
    checked_uploads: int
    checked_durable: int
    corrupted: str = ""
    failures: list[str] = field(default_factory=list)


def _ids(rng: random.Random, n: int) -> list[int]:
    # Distinct ids from a large range: a probe's continuation is unambiguous across everything stored.
    return rng.sample(range(1000, 2_000_000), n)


class Workload(threading.Thread):
    """Acknowledged operations in a loop until the server dies (or ``stop`` is set)."""

    def __init__(self, srv: CorpusServer, exp: Expected, rng: random.Random, trial: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.exp, self.rng, self.trial = srv, exp, rng, trial
        self.stop = threading.Event()
        self.first_ack = threading.Event()  # the kill is timed from here: a loaded machine starts slowly
        self.ops = {"upload": 0, "delete": 0, "commit": 0, "load": 0, "snapshot": 0}
        self.pending: dict[str, list[int]] = {}  # committed over gRPC, waiting for an acknowledged snapshot
        self.lock = threading.Lock()
        self.error = ""

    def run(self) -> None:
        try:
            with self.srv.http() as http, CorpusClient(self.srv.target, NS, timeout=5.0) as client:
                remote = RemoteNgramCorpus(self.srv.target, NS, token=TOKEN)  # gRPC external corpora: admin calls
                try:
                    k = 0
                    while not self.stop.is_set():
                        k += 1
                        op = self.rng.choices(["upload", "delete", "commit", "load", "snapshot"], [4, 1, 4, 1, 2])[0]
                        getattr(self, "op_" + op)(http, client, remote, f"t{self.trial}k{k}")
                        self.ops[op] += 1
                        self.first_ack.set()
                finally:
                    remote.close()
        except Exception as e:  # noqa: BLE001 - the kill ends the workload with a connection error
            self.error = f"{type(e).__name__}: {e}"[:200]

    def op_upload(self, http, client, remote, name: str) -> None:
        docs = [_ids(self.rng, self.rng.randint(20, 300)) for _ in range(self.rng.randint(1, 3))]
        body = "".join(json.dumps({"ids": d}) + "\n" for d in docs)
        self.exp.maybe[name] = docs[0]
        r = http.put(f"/v1/namespaces/{NS}/corpora/{name}", params={"format": "jsonl"}, content=body)
        if r.status_code != 202:
            raise RuntimeError(f"upload {name}: {r.status_code} {r.text}")
        self.exp.uploads[name] = self.exp.maybe.pop(name)

    def op_delete(self, http, client, remote, name: str) -> None:
        if not self.exp.uploads:
            return
        victim = self.rng.choice(sorted(self.exp.uploads))
        self.exp.maybe[victim] = self.exp.uploads.pop(victim)  # gone or not, until the 204
        r = http.delete(f"/v1/namespaces/{NS}/corpora/{victim}")
        if r.status_code != 204:
            raise RuntimeError(f"delete {victim}: {r.status_code} {r.text}")
        self.exp.maybe.pop(victim)
        self.exp.deleted.add(victim)

    def op_commit(self, http, client, remote, name: str) -> None:
        seq = _ids(self.rng, self.rng.randint(24, 200))
        client.start_request(name, seq[:2])
        client.extend(name, seq[2:])
        client.finish(name)
        client.synchronize()  # applied to the learned corpus before the next snapshot starts
        with self.lock:
            self.pending[name] = seq

    def op_load(self, http, client, remote, name: str) -> None:
        doc = _ids(self.rng, self.rng.randint(20, 200))
        n = remote.load_external_corpus_named(name, [doc])
        remote.commit_external_corpus_load(name, n)
        with self.lock:
            self.pending[name] = doc

    def op_snapshot(self, http, client, remote, name: str) -> None:
        with self.lock:
            covered = dict(self.pending)  # applied before the snapshot began: it must hold them
        r = http.post("/v1/snapshot")
        if r.status_code != 200:
            raise RuntimeError(f"snapshot: {r.status_code} {r.text}")
        self.exp.durable.update(covered)
        with self.lock:
            for k in covered:
                self.pending.pop(k, None)


def has_path(tokens: list[int], parents: list[int], path: list[int]) -> bool:
    """Whether the draft tree holds ``path`` as a chain from the root."""
    frontier = [-1]
    for tok in path:
        frontier = [i for i, (t, p) in enumerate(zip(tokens, parents)) if t == tok and p in frontier]
        if not frontier:
            return False
    return True


def continues(client: CorpusClient, rid: str, seq: list[int]) -> bool:
    """Whether the corpus still holds ``seq``: a probe with its first PROBE tokens drafts the next
    CHECK as a chain. Durability is about the content, not its rank among other candidates, so
    the chain may be anywhere in a wider tree."""
    client.start_request(rid, seq[:PROBE])
    tokens, parents, _ = client.draft([rid], 4 * CHECK).tree(0)
    client.finish(rid)
    return has_path(list(tokens), list(parents), seq[PROBE:PROBE + CHECK])


def wait_uploads_ready(srv: CorpusServer, must: set[str], may: set[str] = frozenset(), timeout: float = 120.0) -> dict[str, dict]:
    """The corpus list once every name in ``must`` is built and every listed name in ``may`` too
    (restarts rebuild acknowledged uploads in the background)."""
    deadline = time.monotonic() + timeout
    with srv.http() as http:
        while True:
            listed = {c["name"]: c for c in http.get(f"/v1/namespaces/{NS}/corpora").json()}
            built = all(listed.get(n, {}).get("state") in ("ready", "failed") for n in must) and all(
                listed[n]["state"] in ("ready", "failed") for n in may if n in listed)
            if built or time.monotonic() > deadline:
                return listed
            time.sleep(0.05)


def verify(srv: CorpusServer, exp: Expected, data_dir: Path, expect_snapshot_error: bool = False,
           timeout: float = 120.0) -> tuple[list[str], int, int]:
    """Checks every acknowledgement against the restarted server; returns (failures, uploads, durable)."""
    failures = []
    listed = wait_uploads_ready(srv, set(exp.uploads), set(exp.maybe), timeout)
    with srv.http() as http:
        for name, first_doc in exp.uploads.items():
            entry = listed.get(name)
            if entry is None or entry["state"] != "ready":
                failures.append(f"acknowledged upload {name} missing or not ready: {entry}")
        for name in exp.deleted:
            if name in listed:
                failures.append(f"acknowledged delete {name} came back: {listed[name]}")
        integrity = http.get("/v1/integrity")
        if integrity.status_code != 200 or not integrity.json()["ok"]:
            failures.append(f"integrity: {integrity.status_code} {integrity.text}")
        snap_err = http.get(f"/v1/namespaces/{NS}").json()["snapshot_error"]
        if bool(snap_err) != expect_snapshot_error:
            failures.append(f"snapshot_error: expected {'one' if expect_snapshot_error else 'none'}, got {snap_err!r}")
    with CorpusClient(srv.target, NS, timeout=10.0) as client:
        for name, first_doc in exp.uploads.items():
            if not continues(client, "probe-" + name, first_doc):
                failures.append(f"acknowledged upload {name} does not draft its content")
        for name, seq in exp.durable.items():
            if not continues(client, "probe-" + name, seq):
                failures.append(f"commit {name} covered by an acknowledged snapshot does not draft")
        for name, first_doc in exp.maybe.items():  # unacknowledged: present whole or absent, never partial
            entry = listed.get(name)
            if entry is None:
                continue
            if entry["state"] != "ready" or not continues(client, "probe-" + name, first_doc):
                failures.append(f"unacknowledged upload {name} is present but not whole: {entry}")
    leftovers = list((data_dir / "uploads").glob("*/.*.incoming"))
    if leftovers:
        failures.append(f"partial uploads left on disk: {leftovers}")
    return failures, len(exp.uploads), len(exp.durable)


def corrupt_snapshot(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:
        cut = rng.randrange(1, len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"truncated to {cut} of {len(data)} bytes"
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"flipped a bit of byte {i} of {len(data)}"


def _server(data_dir: Path, snapshot_interval_s: float) -> CorpusServer:
    # No admin rate limit: the workload's uploads, deletes and snapshots come as fast as the server acknowledges them.
    return persistent_server(data_dir, "--snapshot-interval-s", str(snapshot_interval_s), "--max-upload-bytes", "10000000",
                         "--admin-rate-per-s", "0")


def run_trial(data_dir: Path, exp: Expected, rng: random.Random, trial: int, max_kill_s: float = 1.5,
              corrupt: bool = False, snapshot_interval_s: float = 0.25) -> TrialResult:
    srv = _server(data_dir, snapshot_interval_s).start()
    work = Workload(srv, exp, rng, trial)
    try:
        work.start()
        work.first_ack.wait(60)
        kill_after = rng.uniform(0.0, max_kill_s)
        time.sleep(kill_after)
    finally:
        srv.kill()  # kill -9: no drain, no snapshot
        work.stop.set()
    work.join(60)
    t0 = time.monotonic()
    srv = _server(data_dir, snapshot_interval_s).start()
    restart_s = time.monotonic() - t0
    result = TrialResult(trial, round(kill_after, 3), dict(work.ops), round(restart_s, 3), 0, 0)
    try:
        failures, result.checked_uploads, result.checked_durable = verify(srv, exp, data_dir)
        result.failures += failures
        # Settle the unknowns: what survived is held to the same promise from now on.
        listed = wait_uploads_ready(srv, set(), timeout=0)
        for name, doc in exp.maybe.items():
            if name in listed:
                exp.uploads[name] = doc
        exp.maybe.clear()
    finally:
        srv.stop()
    if corrupt:
        result.corrupted = corrupt_snapshot(data_dir / "snapshots" / f"{NS}.ngc", rng)
        srv = _server(data_dir, snapshot_interval_s).start()
        try:
            exp.durable.clear()  # the refused snapshot held them: the namespace starts empty (reported)
            failures, _, _ = verify(srv, exp, data_dir, expect_snapshot_error=True)
            result.failures += [f"after corruption ({result.corrupted}): {f}" for f in failures]
            with srv.http() as http:
                err = http.get(f"/v1/namespaces/{NS}").json()["snapshot_error"] or ""
            if "refused" not in err or not list((data_dir / "snapshots").glob(f"{NS}.ngc.corrupt-*")):
                result.failures.append(f"corrupt snapshot not refused and moved aside: {err!r}")
            with srv.http() as http:  # a good snapshot again, for the next trial
                http.post("/v1/snapshot").raise_for_status()
        finally:
            srv.stop()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kill-s", type=float, default=1.5, help="the kill comes a uniform delay in (0, this) after the first acknowledged operation")
    ap.add_argument("--corrupt-every", type=int, default=5, help="damage the snapshot after every N-th trial (0 = never)")
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a fresh temporary folder")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "crash_soak.json")
    args = ap.parse_args()
    import tempfile

    rng = random.Random(args.seed)
    exp = Expected()
    results: list[TrialResult] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crash-soak-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        for trial in range(args.trials):
            corrupt = bool(args.corrupt_every) and (trial + 1) % args.corrupt_every == 0
            r = run_trial(data_dir, exp, rng, trial, args.max_kill_s, corrupt)
            results.append(r)
            print(f"trial {trial}: kill after {r.kill_after_s:.2f}s ops={r.ops} uploads={r.checked_uploads} "
                  f"durable={r.checked_durable} {r.corrupted} failures={len(r.failures)}", file=sys.stderr)
            for f in r.failures:
                print("  FAIL " + f, file=sys.stderr)
    failed = [r for r in results if r.failures]
    ops = {k: sum(r.ops[k] for r in results) for k in results[0].ops} if results else {}
    summary = {
        "trials": len(results), "failed_trials": len(failed), "seed": args.seed,
        "corrupted_snapshots": sum(1 for r in results if r.corrupted),
        "acknowledged_uploads_checked": sum(r.checked_uploads for r in results),
        "durable_commits_checked": sum(r.checked_durable for r in results),
        "ops": ops, "restart_s_max": max((r.restart_s for r in results), default=0.0),
        "wall_s": round(time.monotonic() - t0, 1),
        "results": [r.__dict__ for r in results],
    }
    write_report(args.out, summary, {k: v for k, v in summary.items() if k != "results"})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
