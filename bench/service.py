"""Corpus service benchmark: closed-loop decode steps over gRPC vs the in-process engine, and the
transport floor (a bare grpc.aio bidirectional echo with the same message sizes).

C clients (one Session each: asyncio tasks of this process, or with --client-procs one process
each, so that one client's Python work never delays another's measurement) each keep a batch of
B live requests from the traces; a step sends the batch's newly committed tokens (accepted draft +
bonus, replayed from the true outputs) and the prompts of requests that replaced finished ones,
and drafts budget-15 trees for the whole batch, then waits for them. The
step latency is how long a client waits between sending a batch's new tokens and holding its
drafts. The same steps run against an in-process NgramCorpus as the same-run baseline (draft +
extends, and the same plus the step's new requests, which the remote step also carries). The
corpus server and the echo server are separate processes on 127.0.0.1.

  python bench/service.py                          # C in 1,4,16 x B in 1,16,64, budget 15
  python bench/service.py --clients 1 4 --batches 64 --steps 100
  python bench/service.py --clients 4 --batches 64 --client-procs
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.acceptance import accept_path  # noqa: E402
from bench.common import CorpusServer, load_average, percentiles, write_report  # noqa: E402
from bench.traces import REPO, default_trace_files, load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402
from corpus_service.client import AsyncCorpusClient  # noqa: E402
from corpus_service.server.config import NamespaceSpec  # noqa: E402


def namespace_spec(settings: list[str]) -> str:
    """The served namespace: "default" with the --set CorpusConfig settings."""
    return "default:" + ",".join(settings) if settings else "default"

ECHO_METHOD = "/bench.Echo/Session"


class Workload:
    """Requests from the traces, dealt to a batch; replays accepted tokens as a verifier would."""

    def __init__(self, traces, offset: int, batch: int) -> None:
        self.traces, self.next, self.batch = traces, offset, batch
        self.live: dict[str, tuple[object, int]] = {}  # rid -> (trace, committed output tokens)
        self.serial = 0

    def refill(self, start) -> None:
        while len(self.live) < self.batch:
            t = self.traces[self.next % len(self.traces)]
            self.next += 1
            self.serial += 1
            rid = f"{self.serial}"
            self.live[rid] = (t, 0)
            start(rid, t.prompt_ids)

    def commit(self, rids, batch, extend, finish) -> int:
        """Accepts each tree against the true output; returns committed tokens."""
        total = 0
        for i, rid in enumerate(rids):
            t, done = self.live[rid]
            truth = t.output_ids[done:]
            toks, pars, _ = batch.tree(i)
            n = min(accept_path(toks, pars, truth[:-1] if len(truth) > 1 else []) + 1, len(truth))
            extend(rid, truth[:n])
            total += n
            if done + n >= len(t.output_ids):
                finish(rid)
                del self.live[rid]
            else:
                self.live[rid] = (t, done + n)
        return total


async def remote_client(target: str, traces, offset: int, batch: int, budget: int, steps: int, warmup: int):
    c = AsyncCorpusClient(target, timeout=30.0)
    w = Workload(traces, offset, batch)
    lat, tokens = [], 0
    try:
        for s in range(steps + warmup):
            calls: list = []  # the client's buffered calls are awaitable: collected, then awaited
            w.refill(lambda *a: calls.append(c.start_request(*a)))
            for call in calls:
                await call
            rids = list(w.live)
            t0 = time.perf_counter()
            drafts = await c.draft(rids, budget)
            dt = time.perf_counter() - t0
            calls = []
            committed = w.commit(rids, drafts, lambda *a: calls.append(c.extend(*a)),
                                 lambda *a: calls.append(c.finish(*a)))
            for call in calls:
                await call
            if s >= warmup:
                lat.append(dt)
                tokens += committed
    finally:
        await c.close()
    return lat, tokens


def local_run(traces, clients: int, batch: int, budget: int, steps: int,
              config: CorpusConfig) -> tuple[list[float], list[float], int]:
    """The same steps in process (clients one after another: the engine is called directly).
    Returns per-step latencies of draft + extends, the same plus the step's new requests (which the
    remote step carries too), and committed tokens."""
    eng = NgramCorpus(config)
    lat, lat_starts, tokens = [], [], 0
    for ci in range(clients):
        w = Workload(traces, ci * 97, batch)
        for _ in range(steps):
            t0 = time.perf_counter()
            w.refill(lambda r, p: eng.start_request(f"{ci}:{r}", p))
            t_start = time.perf_counter() - t0
            rids = list(w.live)
            t0 = time.perf_counter()
            drafts = eng.draft([f"{ci}:{r}" for r in rids], budget)
            lat.append(time.perf_counter() - t0)
            pend: list = []
            tokens += w.commit(rids, drafts, lambda r, tk: pend.append((r, tk)), lambda r: pend.append((r, None)))
            t0 = time.perf_counter()
            for r, tk in pend:  # the extends are part of a step's cost too
                eng.finish(f"{ci}:{r}") if tk is None else eng.extend(f"{ci}:{r}", tk)
            lat[-1] += time.perf_counter() - t0
            lat_starts.append(lat[-1] + t_start)
    return lat, lat_starts, tokens


def _client_process(target: str, offset: int, batch: int, budget: int, steps: int, warmup: int, barrier, results) -> None:
    """One client in its own process (spawned: gRPC must not be forked)."""
    traces = [t for f in default_trace_files() for t in load_traces(f)]

    async def run():
        barrier.wait()
        t0 = time.monotonic()
        lat, tokens = await remote_client(target, traces, offset, batch, budget, steps, warmup)
        results.put((lat, tokens, t0, time.monotonic()))

    asyncio.run(run())


def remote_processes(target: str, clients: int, batch: int, budget: int, steps: int, warmup: int) -> tuple[list, int, float]:
    """C clients, one process each, released together; returns latencies, tokens, wall seconds."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(target, ci * 97, batch, budget, steps, warmup, barrier, results), daemon=True)
             for ci in range(clients)]
    for p in procs:
        p.start()
    out = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    wall = max(o[3] for o in out) - min(o[2] for o in out)
    return [x for o in out for x in o[0]], sum(o[1] for o in out), wall


# ---------------------------------------------------------------------- the transport floor


def echo_server_main() -> None:
    """Replies to each message with as many bytes as its first 4 bytes ask for."""
    async def run():
        async def session(requests, context):
            async for msg in requests:
                yield b"\x01" * int.from_bytes(msg[:4], "little")

        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(session)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Session": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


async def echo_client(target: str, request_bytes: int, reply_bytes: int, steps: int, warmup: int) -> list[float]:
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.stream_stream(ECHO_METHOD)()
        msg = reply_bytes.to_bytes(4, "little") + b"\x02" * max(0, request_bytes - 4)
        lat = []
        for s in range(steps + warmup):
            t0 = time.perf_counter()
            await call.write(msg)
            await call.read()
            if s >= warmup:
                lat.append(time.perf_counter() - t0)
        await call.done_writing()
    return lat


def step_message_sizes(traces, batch: int, budget: int, config: CorpusConfig) -> tuple[int, int]:
    """Bytes of a typical step: ~3 committed tokens per request up, the batch's trees down."""
    from corpus_service.protocol import arrays
    from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb

    eng = NgramCorpus(config)
    rids = [f"{i + 1}" for i in range(batch)]
    for i, r in enumerate(rids):
        t = traces[i % len(traces)]
        eng.start_request(r, t.prompt_ids + t.output_ids[:20])
    req = pb.SessionRequest(seq=1000, namespace="default")
    arrays.pack_runs(req.extend, rids, [[1, 2, 3]] * batch)
    req.draft.req_ids.extend(rids)
    req.draft.budget = budget
    resp = pb.SessionResponse(seq=1000)
    arrays.pack_compact_drafts(resp.drafts, budget, *eng.draft_compact(rids, budget))
    return req.ByteSize(), resp.ByteSize()


async def batch_get_latency(target: str, traces, batch: int, budget: int, steps: int) -> list[float]:
    from corpus_service.protocol import arrays
    from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
    from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        lat = []
        for s in range(steps + 10):
            n = 20 + s  # the contexts grow by one token per step
            ctx = [(t.prompt_ids + t.output_ids)[:n] for t in traces[:batch]]
            req = pb.BatchGetRequest(namespace="default", client_id="bench", draft_token_num=budget + 1,
                                     total_lens=arrays.pack([len(c) for c in ctx], arrays.I64))
            arrays.pack_runs(req.windows, [str(i) for i in range(batch)], [c[-18:] for c in ctx])
            t0 = time.perf_counter()
            await stub.BatchGet(req)
            if s >= 10:
                lat.append(time.perf_counter() - t0)
    return lat


def summarize(lat: list[float], tokens: int = 0, wall: float = 0.0) -> dict:
    """Step latency percentiles (seconds in, microseconds out) and the rates of the run."""
    return {**percentiles(lat, "us", scale=1e6), "steps": len(lat),
            "steps_per_s": round(len(lat) / wall, 1) if wall else None,
            "tokens_per_s": round(tokens / wall, 1) if wall else None}


def start_echo_server() -> tuple[subprocess.Popen, int]:
    """The transport floor's server: this script with --echo-server, which prints its port."""
    proc = subprocess.Popen([sys.executable, __file__, "--echo-server"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the echo server did not start (it printed {line!r})")
    return proc, int(line)


async def measure(args, traces, target: str, echo_target: str) -> dict:
    rows, floors = [], {}
    for batch in args.batches:
        up, down = step_message_sizes(traces, batch, args.budget, args.config)
        floor = summarize(await echo_client(echo_target, up, down, args.steps, args.warmup))
        floors[batch] = {"request_bytes": up, "response_bytes": down, **floor}
        for clients in args.clients:
            steps = max(args.min_steps, args.steps // clients)
            if clients > 1 and args.client_procs:
                lat, tok, wall = await asyncio.to_thread(remote_processes, target, clients, batch, args.budget, steps, args.warmup)
                remote = summarize(lat, tok, wall)
            else:
                t0 = time.perf_counter()
                results = await asyncio.gather(*[remote_client(target, traces, ci * 97, batch, args.budget, steps, args.warmup)
                                                 for ci in range(clients)])
                remote = summarize([x for r in results for x in r[0]], sum(r[1] for r in results), time.perf_counter() - t0)
            t0 = time.perf_counter()
            llat, llat_starts, ltok = local_run(traces, clients, batch, args.budget, steps, args.config)
            local = summarize(llat, ltok, time.perf_counter() - t0)
            local_starts = summarize(llat_starts)
            bound = floor["p50_us"] + local_starts["p50_us"]
            row = {"clients": clients, "batch": batch, "budget": args.budget,
                   "client_processes": clients > 1 and args.client_procs, "remote": remote, "in_process": local,
                   "in_process_with_starts": local_starts,
                   "remote_over_in_process_p50": round(remote["p50_us"] / local["p50_us"], 2),
                   "remote_over_echo_p50": round(remote["p50_us"] / floor["p50_us"], 2),
                   "remote_over_echo_plus_in_process_p50": round(remote["p50_us"] / bound, 2)}
            rows.append(row)
            print(f"C={clients:2d} B={batch:2d}: step p50 {remote['p50_us']:7.0f} us p99 {remote['p99_us']:7.0f} us "
                  f"{remote['steps_per_s']:6.0f} steps/s {remote['tokens_per_s']:7.0f} tok/s | in-process p50 "
                  f"{local['p50_us']:6.0f} us (+starts {local_starts['p50_us']:6.0f}) | echo p50 {floor['p50_us']:5.0f} us "
                  f"({up}+{down} B) | {row['remote_over_echo_p50']:.2f}x echo, "
                  f"{row['remote_over_echo_plus_in_process_p50']:.2f}x echo+in-process", flush=True)
    bg = summarize(await batch_get_latency(target, traces, max(args.batches), args.budget, args.steps))
    print(f"unary BatchGet B={max(args.batches)}: p50 {bg['p50_us']:.0f} us p99 {bg['p99_us']:.0f} us", flush=True)
    return {"rows": rows, "echo": floors, "batch_get": {"batch": max(args.batches), **bg}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--steps", type=int, default=400, help="steps per configuration (split among clients)")
    ap.add_argument("--min-steps", type=int, default=40, help="at least this many steps per client")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--client-procs", action="store_true",
                    help="run each of the C clients in its own process (default: asyncio tasks of this process)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a CorpusConfig setting of the served namespace and of the in-process baseline "
                         "(e.g. draft_threads=2); repeatable")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "service.json")
    ap.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo_server:
        echo_server_main()
        return 0
    # The served namespace's config, for the in-process baseline too (ValueError on a bad setting).
    args.config = NamespaceSpec.parse(namespace_spec(args.set)).corpus
    traces = [t for f in default_trace_files() for t in load_traces(f)]
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = CorpusServer(tmp, "--max-budget", str(args.budget), "--namespace", namespace_spec(args.set)).start()
        echo, echo_port = start_echo_server()
        try:
            result = asyncio.run(measure(args, traces, corpus.target, f"127.0.0.1:{echo_port}"))
        finally:
            corpus.stop()
            echo.terminate()
            echo.wait(30)
    result["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "echo_server", "config")}
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_average()}
    big = next((r for r in result["rows"] if r["clients"] == 1 and r["batch"] == max(args.batches)), result["rows"][-1])
    four = next((r for r in result["rows"] if r["clients"] == 4 and r["batch"] == big["batch"]), None)
    summary = {"batch": big["batch"], "budget": args.budget, "step_p50_us": big["remote"]["p50_us"],
               "echo_floor_p50_us": result["echo"][big["batch"]]["p50_us"],
               "remote_over_echo_p50": big["remote_over_echo_p50"],
               "remote_over_in_process_p50": big["remote_over_in_process_p50"],
               "remote_over_echo_plus_in_process_p50": big["remote_over_echo_plus_in_process_p50"],
               "batch_get_p50_us": result["batch_get"]["p50_us"],
               "load_average": [load_before[0], result["machine"]["loadavg_after"][0]]}
    if four:  # the tail with 4 clients against the median with one
        summary["c4_step_p99_us"] = four["remote"]["p99_us"]
        summary["c4_p99_over_c1_p50"] = round(four["remote"]["p99_us"] / big["remote"]["p50_us"], 2)
    write_report(args.out, result, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
