"""``bench/rollouts.py memory``: a synthetic prompt history added to one corpus, and what it costs by
the engine's accounting (bytes per stored token, against the bound) and in process RSS."""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np

from bench.common import parse_overrides
from bench.rollouts_common import write_out
from corpus_service import CorpusConfig, NgramCorpus


def rss_bytes() -> int:
    """The process's resident set now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synthetic_history(corpus: NgramCorpus, prompts: int, samples: int, tokens: int, seed: int = 0) -> None:
    """``prompts`` keys x ``samples`` rollouts of ``tokens`` output tokens (after the stored prompt
    tail), random tokens of a 49,152-token vocabulary: no n-gram repeats, the index's worst case."""
    rng = np.random.default_rng(seed)
    context = corpus.config.history_context
    for p in range(prompts):
        block = rng.integers(3, 49152, size=(samples, context + tokens), dtype=np.int32)
        for s in range(samples):
            corpus.add_rollout(f"synthetic/{p}", 0, block[s], tokens)


def run_memory(args: argparse.Namespace) -> dict:
    config = CorpusConfig(**parse_overrides(args.set))
    rss0 = rss_bytes()
    corpus = NgramCorpus(config)
    t0 = time.perf_counter()
    synthetic_history(corpus, args.prompts, args.samples, args.tokens)
    seconds = time.perf_counter() - t0
    rss1 = rss_bytes()
    s = corpus.stats()
    bound = config.history_bytes_per_token()
    want_rollouts = args.prompts * args.samples
    res = {
        "mode": "memory", "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "prompts": args.prompts, "samples": args.samples, "output_tokens": args.tokens,
        "context_tokens": config.history_context,
        "history_max_bytes": config.history_max_bytes, "bytes_per_token_bound": bound,
        "history_max_charged_tokens": int(s["history_max_charged_tokens"]),
        "keys": int(s["history_keys"]), "rollouts": int(s["history_rollouts"]), "tokens": int(s["history_tokens"]),
        "charged_tokens": int(s["history_charged_tokens"]), "history_bytes": int(s["history_bytes"]),
        "bytes_per_token": float(s["history_bytes_per_token"]),
        "bytes_per_charged_token": s["history_bytes"] / max(s["history_charged_tokens"], 1),
        "evicted_keys": int(s["history_keys_evicted"]), "dropped_rollouts": int(s["history_rollouts_dropped"]),
        "rss_growth_bytes": rss1 - rss0, "rss_bytes_per_token": (rss1 - rss0) / max(s["history_tokens"], 1),
        "seconds_to_add": round(seconds, 2),
    }
    res["fits"] = res["rollouts"] == want_rollouts and res["evicted_keys"] == 0 and res["dropped_rollouts"] == 0
    res["within_bound"] = res["bytes_per_token"] <= bound and res["history_bytes"] <= config.history_max_bytes
    write_out(args.out, res)
    print(f"SUMMARY rollouts memory: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens "
          f"(+{config.history_context} prompt tail): {res['tokens']:,} tokens stored, "
          f"{res['bytes_per_token']:.1f} B/token by the engine's accounting ({res['bytes_per_charged_token']:.1f} "
          f"per charged token; bound {bound:.0f}), {res['history_bytes'] / 2**30:.2f} GiB of "
          f"{config.history_max_bytes / 2**30:.2f} GiB, fits without eviction: {res['fits']}, RSS +"
          f"{res['rss_growth_bytes'] / 2**30:.2f} GiB ({res['rss_bytes_per_token']:.1f} B/token) -> {args.out}")
    return res
