"""The verifier under a flood of abandoned requests (issue 44's probe): does work for nobody stop?

Against a real ``python -m verifier serve`` (127.0.0.1, an ephemeral port, default admission limits):
1. baseline: a fresh two-token request's latency (median of 3) and the server's RSS, idle;
2. flood: ``--requests`` /v1/completions requests of ``--n`` samples and ``--prompt-tokens`` prompt
   tokens, each sent whole on its own connection and dropped at once (no answer read);
3. right after the last one, a fresh two-token request (retrying on 429 after its Retry-After, as a
   client should; the latency counts from its first try), and the time until the queue is empty and
   nothing runs; RSS once drained;
4. clients that give up: ``--giveup-clients`` requests whose clients close after ``--giveup-s``
   (those beyond the queue's bound were answered 429 at once); the time from their leaving until
   nothing runs;
5. SIGTERM while requests run and wait: the exit code and how long the process took to exit.

Targets (issue 44): the fresh request answered within 2 s, RSS back within 10% of the baseline's,
the queue drained, exit code 0. Ratios are against the baseline measured in the same run.

    python3 bench/verifier_flood.py                      # the probe's sizes (1,500 x n=16 x 500 tokens)
    python3 bench/verifier_flood.py --scale smoke        # tiny (the test suite runs this)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.common import load_average, write_report  # noqa: E402

SCALES = {  # full: the probe
    "full": {"requests": 1500, "n": 16, "prompt_tokens": 500, "giveup_clients": 179, "giveup_s": 3.0, "senders": 8},
    "smoke": {"requests": 40, "n": 4, "prompt_tokens": 50, "giveup_clients": 6, "giveup_s": 0.5, "senders": 2},
}
FRESH = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
RUNNING, WAITING = 'ngram_verifier_requests{state="running"}', 'ngram_verifier_requests{state="waiting"}'


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def refused(m: dict[str, float]) -> int:
    return int(sum(v for k, v in m.items() if k.startswith("ngram_verifier_http_refused_total")))


def abandoned(m: dict[str, float]) -> int:
    return int(sum(v for k, v in m.items() if k.startswith("ngram_verifier_http_abandoned_total")))


def wait_idle(client: httpx.Client, timeout: float) -> float | None:
    """Seconds until nothing waits or runs (None: not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = metrics(client)
        if m[WAITING] == 0 and m[RUNNING] == 0:
            return round(time.monotonic() - t0, 3)
        time.sleep(0.05)
    return None


def request_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: verifier\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def send(port: int, payload: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(payload)
    return s


def flood(port: int, payloads: list[bytes], senders: int) -> float:
    """Every payload sent on a connection of its own and dropped; returns the seconds it took."""
    t0 = time.monotonic()

    def run(part: list[bytes]) -> None:
        for p in part:
            send(port, p).close()

    threads = [threading.Thread(target=run, args=(payloads[i::senders],)) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return round(time.monotonic() - t0, 3)


def fresh_latency(client: httpx.Client, timeout: float) -> tuple[float | None, int]:
    """A fresh two-token request's latency from its first try, retrying after each 429's Retry-After."""
    t0, tries = time.monotonic(), 0
    while time.monotonic() - t0 < timeout:
        tries += 1
        r = client.post("/v1/completions", json=FRESH, timeout=max(1.0, timeout - (time.monotonic() - t0)))
        if r.status_code == 200:
            return round(time.monotonic() - t0, 3), tries
        if r.status_code not in (429, 503):
            raise RuntimeError(f"fresh request: HTTP {r.status_code}: {r.text[:300]}")
        time.sleep(float(r.headers.get("retry-after", "1")))
    return None, tries


def start_server(workdir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, int, Path]:
    ports, log = workdir / "ports.json", workdir / "verifier.log"
    cmd = [sys.executable, "-m", "verifier", "serve", "--model", args.model, "--corpus", args.corpus, "--port", "0",
           "--ports-file", str(ports), "--max-batch", str(args.max_batch), "--max-len", str(args.max_len),
           "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "WARNING"]
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
    end = time.monotonic() + 300
    while not ports.exists():
        if p.poll() is not None or time.monotonic() > end:
            p.kill()
            raise RuntimeError(f"the verifier did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p, json.loads(ports.read_text())["http_port"], log


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    res: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "load_before": load_average()}
    with tempfile.TemporaryDirectory() as tmp:
        p, port, log = start_server(Path(tmp), args)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=args.fresh_timeout) as client:
                base = sorted(fresh_latency(client, args.fresh_timeout)[0] for _ in range(3))
                res["baseline_latency_s"] = base[1]
                res["rss_before_mib"] = rss_mib(p.pid)
                payloads = [request_bytes({"prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)],
                                           "n": args.n}) for _ in range(args.requests)]
                res["flood_sent_s"] = flood(port, payloads, args.senders)
                res["fresh_latency_s"], res["fresh_tries"] = fresh_latency(client, args.fresh_timeout)
                res["drain_s"] = wait_idle(client, args.drain_timeout)  # (from the fresh answer)
                time.sleep(0.5)  # (the allocator's frees settle)
                res["rss_after_mib"] = rss_mib(p.pid)
                m = metrics(client)
                res["flood_refused"], res["flood_abandoned"] = refused(m), abandoned(m)
                res["waiting_tokens_after"] = m["ngram_verifier_waiting_tokens"]

                # Clients that give up after a while (the 179 after 3 s): each one freed.
                socks = [send(port, request_bytes({"prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)],
                                                   "n": args.n})) for _ in range(args.giveup_clients)]
                time.sleep(args.giveup_s)
                for s in socks:
                    s.close()
                res["giveup_freed_s"] = wait_idle(client, args.drain_timeout)
                m = metrics(client)
                res["giveup_abandoned"] = abandoned(m) - res["flood_abandoned"]
                res["giveup_refused"] = refused(m) - res["flood_refused"]  # (429 beyond the queue's bound)
                res["rss_end_mib"] = rss_mib(p.pid)

                # SIGTERM under load: requests running and waiting, their clients still there.
                held = [send(port, request_bytes({"prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)],
                                                  "n": 1, "max_tokens": 200, "ignore_eos": True}))
                        for _ in range(args.max_batch + 4)]
                end = time.monotonic() + 60
                while metrics(client)[RUNNING] == 0 and time.monotonic() < end:
                    time.sleep(0.05)
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            try:
                res["sigterm_exit_code"] = p.wait(timeout=args.shutdown_timeout + 60)
            except subprocess.TimeoutExpired:
                res["sigterm_exit_code"] = None
            res["sigterm_exit_s"] = round(time.monotonic() - t0, 3)
            for s in held:
                s.close()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        text = log.read_text()
        res["log_tracebacks"] = text.count("Traceback")
    res["load_after"] = load_average()
    b, f = res["baseline_latency_s"], res["fresh_latency_s"]
    res["latency_ratio"] = None if f is None or not b else round(f / b, 2)
    res["rss_ratio"] = round(res["rss_after_mib"] / res["rss_before_mib"], 3)
    res["ok"] = bool(f is not None and f <= 2.0 and res["rss_ratio"] <= 1.10 and res["drain_s"] is not None
                     and res["giveup_freed_s"] is not None
                     and res["giveup_abandoned"] + res["giveup_refused"] == args.giveup_clients
                     and res["sigterm_exit_code"] == 0 and res["log_tracebacks"] == 0)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="full", help="counts and sizes (full: the issue's)")
    for name in ("requests", "n", "prompt_tokens", "giveup_clients", "senders"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, help="(default: the scale's)")
    ap.add_argument("--giveup-s", type=float, help="how long the giving-up clients wait (default: the scale's)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--corpus", default="local", help="the verifier's --corpus")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    ap.add_argument("--fresh-timeout", type=float, default=120.0, help="give up on the fresh request after this")
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "verifier_flood.json"))
    a = ap.parse_args(argv)
    for k, v in SCALES[a.scale].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.requests < 1 or a.n < 1 or a.prompt_tokens < 1 or a.giveup_clients < 0 or a.senders < 1:
        ap.error("--requests, --n, --prompt-tokens and --senders must be >= 1, --giveup-clients >= 0")
    res = run(a)
    summary = {k: res[k] for k in ("ok", "fresh_latency_s", "baseline_latency_s", "latency_ratio", "rss_before_mib",
                                   "rss_after_mib", "rss_ratio", "drain_s", "flood_sent_s", "flood_refused",
                                   "flood_abandoned", "giveup_freed_s", "giveup_refused", "sigterm_exit_code", "sigterm_exit_s")}
    summary = {"scale": a.scale, "requests": a.requests, "n": a.n, "prompt_tokens": a.prompt_tokens, **summary}
    write_report(a.out, res, summary)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
