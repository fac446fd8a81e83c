"""Fuzz and load against the corpus server's memory bounds: hostile callers on loopback, and the
server's peak RSS against what its configured limits allow.

1. probe: what one live request and one token cost in server RSS (``probe`` namespace, nothing
   learned: its learned corpus is bounded to 64 KiB), next to what the live-request budget charges;
2. at once, until each is refused or its count or time runs out: BatchGet floods with a fresh client
   id per call; many sessions with many requests each (held until the end); one request extended
   until refused; BatchPut floods of large sequences, never synchronized; malformed and
   out-of-range messages to every gRPC method; hostile REST requests;
3. idle: every caller gone, idle BatchGet state expires; RSS and live requests after.

The bound is the server's RSS at start plus ``--max-live-request-bytes`` plus twice the learned
corpus' ``learned_max_bytes`` (the corpus' only other growth here; it builds its grown copy beside
the live one) plus ``--slack-mib`` for transient message buffers and allocator slack. Counts and
times are bounded (``--seconds`` for phase 2).

    python3 bench/fuzz_load.py                  # full scale, ~1-2 minutes on 2 cores
    python3 bench/fuzz_load.py --scale smoke    # a few seconds (the test suite runs this)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.hostile_cases import grpc_cases, rest_cases, run_grpc, run_rest  # noqa: E402
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb  # noqa: E402
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc  # noqa: E402
from bench.common import ADMIN_TOKEN as TOKEN, CorpusServer, persistent_server, write_report  # noqa: E402
from corpus_service.client import CorpusClient  # noqa: E402
from corpus_service.protocol import arrays  # noqa: E402
from tests.corpus_service.server_health import rss_bytes  # noqa: E402

MIB = 1 << 20
PROBE_CHUNK = 1 << 16  # tokens per commit step of the probe's long request
SCALES = {  # the probe sizes at full scale
    "full": dict(budget_mib=256, learned_mib=64, flood_calls=300, flood_ids=1000, sessions=20, session_requests=5000,
                 session_tokens=64, huge_tokens=8 << 20, huge_chunk=1 << 18, grpc_cases=2000, rest_cases=400,
                 probe_requests=10000, probe_tokens=2 << 20, put_calls=160, put_tokens=1 << 20, idle_s=2.0,
                 seconds=90.0),
    "smoke": dict(budget_mib=16, learned_mib=8, flood_calls=20, flood_ids=200, sessions=3, session_requests=400,
                  session_tokens=64, huge_tokens=600_000, huge_chunk=100_000, grpc_cases=60, rest_cases=40,
                  probe_requests=1000, probe_tokens=2 * PROBE_CHUNK, put_calls=16, put_tokens=1 << 16, idle_s=1.0,
                  seconds=10.0),
}


def metric(srv: CorpusServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{srv.admin_url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def settle_rss(pid: int, seconds: float = 1.0) -> int:
    """RSS once the server is quiet (the housekeeping trim runs every <= 1 s)."""
    time.sleep(seconds)
    return rss_bytes(pid)


def probe(srv: CorpusServer, a: argparse.Namespace) -> dict:
    """Server RSS per live request (16-token prompts) and per token (one long prompt), nothing learned."""
    rng = np.random.default_rng(1)
    pid = srv.proc.pid
    with CorpusClient(srv.target, namespace="probe", timeout=60) as c:
        c.flush()
        r0 = settle_rss(pid)
        for i in range(a.probe_requests):
            c.start_request(f"p{i}", rng.integers(0, 32000, 16).astype(np.int32))
            if i % 1000 == 999:
                c.flush()
        c.flush()
        r1 = settle_rss(pid)
        charged = metric(srv, "ngram_corpus_limit_used", limit="live_request_bytes")
        c.start_request("long", rng.integers(0, 32000, 16).astype(np.int32))
        for _ in range(a.probe_tokens // PROBE_CHUNK):  # commits as a verifier sends them, in steps
            c.extend("long", rng.integers(0, 32000, PROBE_CHUNK).astype(np.int32))
            c.flush()
        r2 = settle_rss(pid)
        charged_long = metric(srv, "ngram_corpus_limit_used", limit="live_request_bytes") - charged
        index = metric(srv, "ngram_corpus_live_request_bytes", namespace="probe")
    tokens = a.probe_tokens // PROBE_CHUNK * PROBE_CHUNK
    return {"requests": a.probe_requests, "rss_per_request_b": round((r1 - r0) / a.probe_requests),
            "charged_per_request_b": round(charged / a.probe_requests),
            "tokens": tokens, "rss_per_token_b": round((r2 - r1) / tokens, 1),
            "charged_per_token_b": round(charged_long / tokens, 1),
            "engine_index_bytes": index}


def flood(srv: CorpusServer, a: argparse.Namespace, deadline: float, out: dict) -> None:
    """BatchGet with a fresh client id per call (no credentials needed without client tokens)."""
    rng = np.random.default_rng(2)
    codes: dict[str, int] = {}
    with grpc.insecure_channel(srv.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        for i in range(a.flood_calls):
            if time.monotonic() > deadline:
                break
            ids = [f"r{j}" for j in range(a.flood_ids)]
            req = pb.BatchGetRequest(namespace="default", client_id=f"flood-{i}", draft_token_num=8,
                                     total_lens=arrays.pack(np.full(len(ids), 8, np.int64), arrays.I64))
            arrays.pack_runs(req.windows, ids, [rng.integers(0, 32000, 8).astype(np.int32) for _ in ids])
            try:
                stub.BatchGet(req, timeout=60)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            codes[code] = codes.get(code, 0) + 1
    out["flood"] = {"calls": sum(codes.values()), "codes": codes}


def session(srv: CorpusServer, a: argparse.Namespace, idx: int, deadline: float, hold: threading.Event,
            out: list) -> None:
    """Starts ``session_requests`` requests (1,000 a step) and holds them until ``hold`` is set."""
    rng = np.random.default_rng(100 + idx)
    live = refused = 0
    with CorpusClient(srv.target, timeout=60) as c:
        for step in range(0, a.session_requests, 1000):
            if time.monotonic() > deadline:
                break
            for i in range(step, min(step + 1000, a.session_requests)):
                c.start_request(f"q{i}", rng.integers(0, 32000, a.session_tokens).astype(np.int32))
            try:
                c.flush()
                live += min(1000, a.session_requests - step)
            except Exception as e:  # noqa: BLE001 - the refusal is what is counted
                if getattr(e, "code", None) != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                refused += 1
        hold.wait(max(0.0, deadline - time.monotonic()))
    out.append({"live": live, "steps_refused": refused})


def huge(srv: CorpusServer, a: argparse.Namespace, deadline: float, out: dict) -> None:
    """One request extended chunk by chunk until a limit refuses it."""
    rng = np.random.default_rng(3)
    held, stop = 0, "count reached"
    with CorpusClient(srv.target, timeout=60) as c:
        c.start_request("huge", rng.integers(0, 32000, a.huge_chunk).astype(np.int32))
        while held < a.huge_tokens and time.monotonic() < deadline:
            if held:
                c.extend("huge", rng.integers(0, 32000, a.huge_chunk).astype(np.int32))
            try:
                c.flush()
                held += a.huge_chunk
            except Exception as e:  # noqa: BLE001 - the refusal is what is measured
                code = getattr(e, "code", None)
                stop = f"{code.name if code is not None else type(e).__name__}: {str(e)[:200]}"
                break
    out["huge"] = {"tokens_held": held, "stopped_by": stop}


def put_flood(srv: CorpusServer, a: argparse.Namespace, deadline: float, out: dict) -> None:
    """BatchPut of large sequences from a few threads, never synchronized (the SGLang learning path)."""
    tokens = np.random.default_rng(4).integers(0, 32000, a.put_tokens).astype(np.int32)
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def one() -> None:
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb_grpc.CorpusStub(ch)
            for _ in range(a.put_calls // 4):
                if time.monotonic() > deadline:
                    return
                req = pb.BatchPutRequest(namespace="default", lengths=arrays.pack([tokens.size]), tokens=tokens.tobytes())
                try:
                    stub.BatchPut(req, timeout=60)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["put_flood"] = {"calls": sum(codes.values()), "tokens_each": a.put_tokens, "codes": codes}


def hostile(srv: CorpusServer, a: argparse.Namespace, deadline: float, out: dict) -> None:
    with grpc.insecure_channel(srv.target) as ch:
        out["grpc"] = run_grpc(ch, grpc_cases(a.seed, a.grpc_cases), deadline, admin_token=TOKEN)
    with httpx.Client(base_url=srv.admin_url, timeout=60) as http:
        out["rest"] = run_rest(http, TOKEN, rest_cases(a.seed, a.rest_cases), deadline)


def run(a: argparse.Namespace, tmp: Path) -> dict:
    srv = persistent_server(tmp, "--namespace", f"default:vocab=32000,learned_max_bytes={a.learned_mib * MIB}",
                        "--namespace", "probe:vocab=32000,learn_prompts=false,learned_max_bytes=65536",
                        "--snapshot-interval-s", "0", "--max-live-request-bytes", str(a.budget_mib * MIB),
                        "--batch-get-idle-s", str(a.idle_s), "--max-upload-bytes", str(1 * MIB))
    srv.start()
    res: dict = {"scale": a.scale, "budget_mib": a.budget_mib, "learned_max_mib": a.learned_mib, "slack_mib": a.slack_mib}
    try:
        pid = srv.proc.pid
        base = rss_bytes(pid)
        res["rss_start_mib"] = round(base / MIB, 1)
        peak = [base]
        stop = threading.Event()

        def sample() -> None:  # the whole run's peak, the probe's included
            while not stop.wait(0.02):
                peak[0] = max(peak[0], rss_bytes(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        res["probe"] = probe(srv, a)
        res["rss_after_probe_mib"] = round(settle_rss(pid, 2 * a.idle_s) / MIB, 1)  # its session closed
        hold = threading.Event()
        deadline = time.monotonic() + a.seconds
        sessions: list = []
        threads = [threading.Thread(target=flood, args=(srv, a, deadline, res)),
                   threading.Thread(target=huge, args=(srv, a, deadline, res)),
                   threading.Thread(target=put_flood, args=(srv, a, deadline, res)),
                   threading.Thread(target=hostile, args=(srv, a, deadline, res))]
        holders = [threading.Thread(target=session, args=(srv, a, i, deadline, hold, sessions))
                   for i in range(a.sessions)]
        t0 = time.monotonic()
        for t in threads + holders:
            t.start()
        for t in threads:
            t.join()
        res["budget_used_at_end_mib"] = round(metric(srv, "ngram_corpus_limit_used", limit="live_request_bytes") / MIB, 1)
        hold.set()
        for t in holders:
            t.join()
        res["phase_s"] = round(time.monotonic() - t0, 1)
        stop.set()
        res["sessions"] = {"sessions": len(sessions), "live": sum(s["live"] for s in sessions),
                           "steps_refused": sum(s["steps_refused"] for s in sessions)}
        res["refused"] = {lim: metric(srv, "ngram_corpus_limit_refused_total", limit=lim)
                          for lim in ("live_request_bytes", "batch_get_clients", "batch_get_requests_per_client")}
        res["rss_peak_mib"] = round(peak[0] / MIB, 1)
        res["bound_mib"] = round(base / MIB + a.budget_mib + 2 * a.learned_mib + a.slack_mib, 1)
        res["peak_growth_vs_limits"] = round((peak[0] - base) / ((a.budget_mib + 2 * a.learned_mib) * MIB), 3)
        after = settle_rss(pid, 3 * a.idle_s)
        res["rss_after_idle_mib"] = round(after / MIB, 1)
        res["live_requests_after_idle"] = sum(metric(srv, "ngram_corpus_live_requests", namespace=ns)
                                              for ns in ("default", "probe"))
        res["learned_mib_end"] = round(metric(srv, "ngram_corpus_learned_bytes", namespace="default") / MIB, 1)
        res["server_alive"] = srv.alive()
    finally:
        srv.stop() if srv.alive() else srv.kill()
    log = srv.log_path.read_text(errors="replace")
    res["log_tracebacks"] = log.count("Traceback")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="full", help="counts and sizes (full: the issue's)")
    ap.add_argument("--seconds", type=float, help="time bound of phase 2 (default: the scale's)")
    ap.add_argument("--slack-mib", type=float, default=64.0, help="transient message buffers and allocator slack")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz_load.json")
    a = ap.parse_args(argv)
    for k, v in SCALES[a.scale].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    with tempfile.TemporaryDirectory(prefix="fuzz-load-") as tmp:
        res = run(a, Path(tmp))
    unclear = res["grpc"]["unclear"] + res["rest"]["unclear"]
    res["ok"] = bool(res["server_alive"] and not unclear and res["rss_peak_mib"] <= res["bound_mib"]
                     and not res["log_tracebacks"] and res["live_requests_after_idle"] == 0)
    p, f, s, h = res["probe"], res["flood"], res["sessions"], res["huge"]
    summary = {"scale": a.scale, "ok": res["ok"], "rss_peak_mib": res["rss_peak_mib"], "bound_mib": res["bound_mib"],
               "rss_start_mib": res["rss_start_mib"], "budget_mib": a.budget_mib, "learned_mib": a.learned_mib,
               "slack_mib": a.slack_mib, "peak_growth_vs_limits": res["peak_growth_vs_limits"],
               "rss_per_request_b": p["rss_per_request_b"], "charged_per_request_b": p["charged_per_request_b"],
               "rss_per_token_b": p["rss_per_token_b"], "charged_per_token_b": p["charged_per_token_b"],
               "flood_admitted": f"{f['codes'].get('OK', 0)}/{f['calls']}", "sessions": s["sessions"],
               "sessions_live_requests": s["live"], "sessions_steps_refused": s["steps_refused"],
               "huge_tokens_held": h["tokens_held"], "hostile_grpc_cases": res["grpc"]["cases"],
               "hostile_rest_cases": res["rest"]["cases"], "unclear": len(unclear),
               "rss_after_idle_mib": res["rss_after_idle_mib"], "live_requests_after_idle": res["live_requests_after_idle"]}
    write_report(a.out, res, summary)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
