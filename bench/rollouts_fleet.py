"""``bench/rollouts.py fleet`` and ``fleet-merge``: each arm's corpus service and replicas run through
the GRPO epochs (every prompt x G samples over HTTP, a new policy between epochs), each epoch's
makespan, tokens/s, MAT and phases; the arms' makespan ratios and summary line, also of arms run
separately and merged."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.fleet_replicas import Proc, announce_version, new_policy, start_corpus, verifier_cmd, wait_healthy
from bench.fleet_stats import add_counters, fetch_text, phase_stats, replica_metrics
from bench.rollouts_common import TRACE_NAMES, Sample, load_samples, trace_path, write_out


async def run_epoch_requests(urls: list[str], prompts: list[Sample], args: argparse.Namespace, epoch: int,
                             send_keys: bool) -> dict:
    """Every prompt x G samples at once (sample s to replica s % R); makespan, tokens, MAT.

    The client is aiohttp: httpx's connection pool adds seconds to 536 concurrent requests (5.7 s
    against aiohttp's 0.35 s on 2 cores, for 4 servers that answer each after 3 s), which a
    makespan measured here would count as the fleet's."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        async def one(p: Sample, s: int) -> dict:
            body = {"prompt": p.prompt_ids, "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "top_p": 1.0, "seed": args.seed * 1_000_003 + epoch * 10_007 + s * 101 + hash_key(p.key)}
            if send_keys:
                body.update(prompt_key=p.key, policy_version=epoch)
            t = time.perf_counter()
            async with http.post(urls[s % len(urls)] + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"replica {s % len(urls)}: HTTP {r.status}: {(await r.text())[:500]}")
                u = (await r.json())["usage"]
            end = time.perf_counter()
            return {"end": end, "latency": end - t, "tokens": u["completion_tokens"],
                    "steps": u.get("verify_steps", 0), "accepted": u.get("accepted_draft_tokens", 0)}

        async def counters() -> dict[str, float]:  # the replicas' engine counters, summed
            out: dict[str, float] = {}
            for text in await asyncio.gather(*(fetch_text(http, u + "/metrics") for u in urls)):
                add_counters(text, out)
            return out

        n = len(prompts) * args.samples
        bulk_live = args.phase_live * len(urls)  # the bulk phase: more than --phase-live requests per replica
        live = {"n": n, "t": None, "task": None}

        async def tracked(p: Sample, s: int) -> dict:
            d = await one(p, s)
            live["n"] -= 1
            if live["n"] <= bulk_live and live["task"] is None:
                live["t"] = time.perf_counter()
                live["task"] = asyncio.ensure_future(counters())
            return d

        c0 = await counters()
        t0 = time.perf_counter()
        done = await asyncio.gather(*(tracked(p, s) for p in prompts for s in range(args.samples)))
        c2 = await counters()
        c1 = await live["task"] if live["task"] is not None else c0
        t1 = live["t"] if live["t"] is not None else t0
    makespan = max(d["end"] for d in done) - t0
    phases = {"bulk": phase_stats(c0, c1, t1 - t0, [d for d in done if d["end"] <= t1]),
              "tail": phase_stats(c1, c2, makespan - (t1 - t0), [d for d in done if d["end"] > t1])}
    tokens = sum(d["tokens"] for d in done)
    steps = sum(d["steps"] for d in done)
    accepted = sum(d["accepted"] for d in done)
    return {"makespan_s": makespan, "tokens": tokens, "tokens_per_s": tokens / max(makespan, 1e-9),
            "mat": (steps + accepted) / steps if steps else 1.0, "requests": len(done),
            "p50_latency_s": float(np.median([d["latency"] for d in done])),
            # Where the makespan went (issue 43): while more than --phase-live requests per replica
            # were live (bulk) and after (tail); the replicas' /metrics read at the boundary.
            "phase_live_per_replica": args.phase_live, "phases": phases}


def hash_key(key: str) -> int:
    """A stable small int of a prompt key (Python's hash() is salted per process)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def fleet_arm(arm: str, prompts: list[Sample], args: argparse.Namespace, work: Path) -> dict:
    """One arm: a corpus service (shared) and R replicas, started once; a new policy every epoch."""
    token = "rollouts-bench-admin-token"
    corpus_proc, target = (None, None)
    if arm == "shared":
        corpus_proc, target = start_corpus(work / arm, token, args.namespace)
    res: dict = {"epochs": {}}
    procs, urls = [], []
    try:
        corpus = {"shared": target, "local": "local", "none": "none"}[arm]
        t_start = time.perf_counter()
        for i in range(args.replicas):
            pf = work / arm / f"replica{i}-ports.json"
            pf.parent.mkdir(parents=True, exist_ok=True)
            procs.append(Proc(verifier_cmd(args, corpus, pf, token), pf, work / arm / f"replica{i}.log"))
        for p in procs:
            urls.append(f"http://127.0.0.1:{p.ports(args.start_timeout_s)['http_port']}")
        wait_healthy(urls, args.start_timeout_s)
        res["replica_start_s"] = round(time.perf_counter() - t_start, 1)
        for epoch in range(args.epochs):
            update_s = 0.0
            if epoch > 0 and args.noise_sigma > 0:
                update_s = asyncio.run(new_policy(urls, args, epoch, announce=arm != "none"))
            elif arm != "none":  # the same weights: only the version moves
                update_s = asyncio.run(announce_version(urls, epoch))
            r = asyncio.run(run_epoch_requests(urls, prompts, args, epoch, send_keys=not args.no_history_fields))
            r["policy_update_s"] = round(update_s, 2)
            res["epochs"][str(epoch)] = r
            print(f"  fleet {arm} epoch {epoch}: makespan {r['makespan_s']:.2f} s, {r['tokens_per_s']:.0f} tok/s, "
                  f"MAT {r['mat']:.3f} ({r['requests']} requests, {r['tokens']} tokens; new policy in "
                  f"{update_s:.1f} s)", flush=True)
        res["replicas_metrics"] = replica_metrics(urls)
        for p in procs:  # (a replica hands its last finished rollouts to the corpus as it stops)
            p.stop()
        if arm == "shared":  # what the fleet left in the corpus: its history, the learned source weights
            from corpus_service.client import CorpusClient

            with CorpusClient(target, args.namespace.split(":")[0]) as c:
                st = c.stats()
            res["corpus"] = {k: st[k] for k in st if k.startswith(("history_", "source_", "policy_version"))}
    finally:
        for p in procs:
            p.stop()
        if corpus_proc is not None:
            corpus_proc.stop()
    return res


def run_fleet(args: argparse.Namespace) -> dict:
    path = trace_path(args.trace[0] if args.trace else TRACE_NAMES[1])
    rows = load_samples(path, args.prompts, 1)
    prompts = [r for r in rows if r.sample == 0]  # one row per prompt: its ids and key
    results: dict = {"mode": "fleet", "date": time.strftime("%Y-%m-%d", time.gmtime()), "trace": path.name,
                     "prompts": len(prompts), "samples": args.samples, "replicas": args.replicas,
                     "epochs": args.epochs, "temperature": args.temperature, "max_tokens": args.max_tokens,
                     "noise_sigma": args.noise_sigma, "device": args.device, "dtype": args.dtype,
                     "gpu_share": args.replicas if args.device.startswith("cuda") else None,
                     "verifier_arg": list(args.verifier_arg), "arms": {}}
    with tempfile.TemporaryDirectory(prefix="rollouts-fleet-") as tmp:
        for arm in args.arms or ["shared", "local", "none"]:
            results["arms"][arm] = fleet_arm(arm, prompts, args, Path(tmp))
    return fleet_summary(results, args.out)


def fleet_summary(results: dict, out: str) -> dict:
    """Epoch-last makespan ratios of the arms present; writes ``out`` and prints the summary line."""
    a = results["arms"]
    last = str(results["epochs"] - 1)
    ratios = {}
    if "shared" in a and "none" in a:
        ratios["makespan_none_over_shared"] = a["none"]["epochs"][last]["makespan_s"] / a["shared"]["epochs"][last]["makespan_s"]
    if "shared" in a and "local" in a:
        ratios["makespan_local_over_shared"] = a["local"]["epochs"][last]["makespan_s"] / a["shared"]["epochs"][last]["makespan_s"]
    results["ratios"] = ratios
    write_out(out, results)
    print(f"SUMMARY rollouts fleet: R={results['replicas']} G={results['samples']} T={results['temperature']} "
          f"{results['prompts']} prompts, epoch {last}: "
          + " ".join(f"{arm} makespan {a[arm]['epochs'][last]['makespan_s']:.2f} s MAT "
                     f"{a[arm]['epochs'][last]['mat']:.3f}" for arm in a)
          + " | " + " ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + f" -> {out}")
    return results


def run_fleet_merge(args: argparse.Namespace) -> dict:
    """Fleet runs of one schedule made arm by arm (a machine's per-command time limit), merged into one
    result: the settings must agree, each arm may appear once."""
    parts = [json.loads(Path(p).read_text()) for p in args.inputs]
    same = ("trace", "prompts", "samples", "replicas", "epochs", "temperature", "max_tokens", "noise_sigma", "device",
            "dtype", "gpu_share")
    merged = {k: v for k, v in parts[0].items() if k not in ("arms", "ratios")}
    merged["arms"] = {}
    for p, part in zip(args.inputs, parts):
        if part.get("mode") != "fleet":
            raise SystemExit(f"{p}: not a fleet result")
        diff = [k for k in same if part.get(k) != merged.get(k)]
        if diff:
            raise SystemExit(f"{p}: another schedule than {args.inputs[0]} ({', '.join(diff)} differ)")
        for arm, res in part["arms"].items():
            if arm in merged["arms"]:
                raise SystemExit(f"{p}: arm '{arm}' appears twice")
            merged["arms"][arm] = res
    merged["merged_from"] = list(args.inputs)
    return fleet_summary(merged, args.out)
