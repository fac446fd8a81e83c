"""Engine cost benchmark: the per-request costs a verifier pays, on real trace tokens.

Measures (CPU time of the calling thread, medians over repeats): drafting at budget 15 for a batch of
64 live requests and for one request per call, and for a request caught in a 30,000-token generation
loop, extending by 3 tokens, starting a request with a 2,000-token prompt, bulk loading an external
corpus, and bytes per learned token. Same-run baseline:
prompt lookup in pure Python (the cheapest drafting a verifier could do without this engine).

  python bench/engine_costs.py [--out bench/results/engine_costs.json] [--set FIELD=VALUE ...]

With --set, the engine runs the overridden CorpusConfig, and drafting and extending are also timed
against the default config in the same run, alternating between the two engines (this machine's
noise moves both alike), e.g. the cost of acceptance feedback: --set feedback=true, of the rank model:
--set rank_model=true. With --arm (repeatable) only that comparison runs, for several configs in the
same rounds: --arm rank_model=true,rank_depth=0 --arm rank_model=true,rank_depth=3. The learned half
of the traces is decoded step by step (draft, accept, commit), so the acceptance models are trained
when the timed drafts run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import accept_path, prompt_lookup_chain  # noqa: E402
from bench.common import parse_overrides, write_report  # noqa: E402
from bench.traces import REPO, default_trace_files, load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402

TARGETS_US = {"draft_b15_batched": 5.0, "extend": 3.0, "start_2000": 100.0}


def timed(fn, repeats: int) -> float:
    """Median CPU seconds of fn() over repeats (thread time: robust to other processes)."""
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        samples.append(time.thread_time() - t0)
    return statistics.median(samples)


def build(config: CorpusConfig, traces: list, live: list[str]) -> NgramCorpus:
    corpus = NgramCorpus(config)
    half = len(traces) // 2
    for k, t in enumerate(traces[:half]):  # the learned corpus holds half of the traces
        corpus.start_request(f"w{k}", t.prompt_ids)
        # Decoded as a verifier would (draft, accept, commit): the acceptance models learn from these
        # steps, so drafts below are timed against trained tables, as in a running service.
        out, i = t.output_ids, 0
        while i < len(out):
            toks, parents, _ = corpus.draft([f"w{k}"], 15).tree(0)
            a = accept_path(toks, parents, out[i:])
            corpus.extend(f"w{k}", out[i:i + a + 1])
            i += a + 1
        corpus.finish(f"w{k}")
    corpus.synchronize()
    for rid, t in zip(live, traces[half:]):
        corpus.start_request(rid, t.prompt_ids + t.output_ids[: len(t.output_ids) // 2])
    # The live requests' prompts are learned asynchronously: let that finish, so the timings below
    # are of drafting and extending, not of waiting on the insert thread's exclusive lock.
    corpus.synchronize()
    return corpus


def step_costs(corpus: NgramCorpus, live: list[str]) -> tuple[float, float]:
    """Microseconds: a batched B=15 draft per request, and an extend after a draft (medians)."""
    draft = timed(lambda: corpus.draft(live, 15), 20) / len(live)
    extends = []
    for _ in range(50):
        corpus.draft(live[-1:], 15)
        t0 = time.thread_time()
        corpus.extend(live[-1], [3, 4, 5])
        extends.append(time.thread_time() - t0)
    return 1e6 * draft, 1e6 * statistics.median(extends)


def alternate(engines: dict[str, NgramCorpus], live: list[str], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """``step_costs`` of each engine in turn, round by round (same state, same requests: the machine's
    drift moves them alike); per engine its (draft, extend) microseconds of every round."""
    costs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, corpus in engines.items():
            costs[name].append(step_costs(corpus, live))
    return costs


def versus_default(corpus: NgramCorpus, default: NgramCorpus, live: list[str]) -> dict[str, float]:
    """Alternates rounds between the configured and the default engine: each one's median costs."""
    rounds = alternate({"set": corpus, "default": default}, live, 30)
    med = {k: (statistics.median(d for d, _ in v), statistics.median(e for _, e in v)) for k, v in rounds.items()}
    return {"ab_draft_b15_set": med["set"][0], "ab_draft_b15_default": med["default"][0],
            "ab_extend_set": med["set"][1], "ab_extend_default": med["default"][1]}


def arms_versus_default(traces: list, live: list[str], arms: list[str], rounds: int = 40) -> dict:
    """Each arm (``FIELD=VALUE,FIELD=VALUE``, a CorpusConfig) and the default in turn (``alternate``):
    per arm the median over rounds of its draft and extend time over the default's in that round."""
    engines = {"default": build(CorpusConfig(request_ttl_s=0), traces, live)}
    for arm in arms:
        engines[arm] = build(CorpusConfig(request_ttl_s=0, **parse_overrides(arm.split(","))), traces, live)
    costs = alternate(engines, live, rounds)
    out = {}
    for arm in arms:
        ratios = [(a[0] / b[0], a[1] / b[1]) for a, b in zip(costs[arm], costs["default"])]
        out[arm] = {"draft_over_default": round(statistics.median(d for d, _ in ratios), 3),
                    "extend_over_default": round(statistics.median(e for _, e in ratios), 3)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_costs.json"))
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="CorpusConfig override")
    ap.add_argument("--arm", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE...]",
                    help="only compare configs: each arm's draft and extend against the default's, round by round")
    ap.add_argument("--rounds", type=int, default=40, help="with --arm: rounds (each arm and the default once)")
    ap.add_argument("--trace", action="append", default=[], help="trace file (repeatable); default: the dev traces")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    overrides = parse_overrides(args.set)

    traces = [t for f in (args.trace or default_trace_files()) for t in load_traces(f)]
    stream = np.array([tok for t in traces for tok in t.prompt_ids + t.output_ids], dtype=np.int32)
    live = [f"q{k}" for k in range(min(64, len(traces) - len(traces) // 2))]  # one per trace not learned
    if args.arm:
        res = {"arms": arms_versus_default(traces, live, args.arm, args.rounds)}
        write_report(args.out, res, {f"{arm}: {k}": v for arm, r in res["arms"].items() for k, v in r.items()})
        return res
    corpus = build(CorpusConfig(request_ttl_s=0, **overrides), traces, live)

    res: dict[str, float] = {}
    s0 = corpus.stats()
    res["draft_b15_batched"] = 1e6 * timed(lambda: corpus.draft(live, 15), 200) / len(live)
    s1 = corpus.stats()
    # The engine's own clock around its draft loop (wall time, so it includes any preemption).
    res["draft_b15_engine"] = 1e6 * (s1["draft_seconds"] - s0["draft_seconds"]) / (s1["drafts"] - s0["drafts"])
    res["draft_b15_single"] = 1e6 * timed(lambda: corpus.draft(live[:1], 15), 2000)
    # Each extend follows a draft, as in a verifier step (with feedback on, it scores that draft).
    ext = [3, 4, 5]
    extends = []
    for _ in range(3000):
        corpus.draft(live[:1], 15)
        t0 = time.thread_time()
        corpus.extend("q0", ext)
        extends.append(time.thread_time() - t0)
    res["extend"] = 1e6 * statistics.median(extends)

    # Starting a request with a 2,000-token prompt; each is finished (untimed) before the next, as
    # in a server whose live requests come and go.
    prompt = stream[:2000]
    starts = []
    for i in range(300):
        t0 = time.thread_time()
        corpus.start_request(f"s{i}", prompt)
        starts.append(time.thread_time() - t0)
        corpus.finish(f"s{i}")
    corpus.synchronize()
    res["start_2000"] = 1e6 * statistics.median(starts)
    big = np.tile(stream, max(1, 4_000_000 // len(stream)))
    n = 0

    def load() -> None:
        nonlocal n
        n += 1
        corpus.load_external_corpus_named(f"bulk{n}", [big])
        corpus.commit_external_corpus_load(f"bulk{n}")
        corpus.remove_external_corpus(f"bulk{n}")

    res["bulk_load_mtok_s"] = len(big) / timed(load, 3) / 1e6
    corpus.synchronize()
    res["bytes_per_learned_token"] = corpus.stats()["learned_bytes_per_token"]
    # A request caught in a generation loop (a 3-token cycle, 30,000 tokens): its own chunks crowd
    # the learned corpus's chains for the loop's n-grams (TokenIndex::find bounds their walk).
    corpus.start_request("loop", [7])
    for _ in range(10_000):
        corpus.extend("loop", [3, 4, 5])
    corpus.synchronize()
    res["draft_loop_30k"] = 1e6 * timed(lambda: corpus.draft(["loop"], 15), 200)
    res["ratio_draft_loop_vs_single"] = res["draft_loop_30k"] / res["draft_b15_single"]
    corpus.finish("loop")

    # Baseline: pure-Python prompt lookup for one request (what a verifier does without an engine).
    half = len(traces) // 2
    ctx = (traces[half].prompt_ids + traces[half].output_ids)[:600]
    res["baseline_prompt_lookup_us"] = 1e6 * timed(lambda: prompt_lookup_chain(ctx, 15), 200)
    res["ratio_draft_single_vs_prompt_lookup"] = res["draft_b15_single"] / res["baseline_prompt_lookup_us"]
    if overrides:  # last: its extends make a request's context repetitive (slower drafts)
        res.update(versus_default(corpus, build(CorpusConfig(request_ttl_s=0), traces, live), live))

    keys = ("draft_b15_batched", "draft_b15_engine", "draft_b15_single", "ratio_draft_single_vs_prompt_lookup",
            "draft_loop_30k", "ratio_draft_loop_vs_single", "extend", "start_2000", "bulk_load_mtok_s",
            "bytes_per_learned_token")
    summary = {k: round(res[k], 3) for k in keys}
    if overrides:  # the same run, alternating with the default config
        summary["ab_draft_b15_set_over_default"] = round(res["ab_draft_b15_set"] / res["ab_draft_b15_default"], 3)
        summary["ab_extend_set_over_default"] = round(res["ab_extend_set"] / res["ab_extend_default"], 3)
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
