"""vLLM-pattern replay: the corpus driven as vLLM 0.33.0's suffix proposer drives its cache, against
ArcticInference's SuffixDecoding (what vLLM's ``--speculative-config '{"method": "suffix"}'`` runs)
in the same run.

vLLM's ``SuffixDecodingProposer.propose`` (``vllm/v1/spec_decode/suffix_decoding.py``), per decode
step and request: a new request starts with its prompt, the step's sampled tokens (accepted drafts
plus one) are added, and ``speculate`` drafts a chain of at most ``num_speculative_tokens`` from the
last ``suffix_decoding_max_tree_depth`` (24) tokens; a request that left the batch is stopped (its
response stays in the global tree of ``max_cached_requests`` = 10,000). The contenders:

- ``suffix``: ArcticInference's own ``SuffixDecodingCache`` (the ``arctic-inference`` package,
  0.1.1, the version vLLM names), called exactly so, at vLLM's defaults (max_tree_depth 24,
  max_cached_requests 10,000, max_spec_factor 1.0, min_token_prob 0.1);
- ``corpus``: the plugin's ``CorpusBridge`` (the code vLLM's patched proposer runs on its leader
  rank) against a corpus server on 127.0.0.1 (namespace ``default:rank_model=true``, docs/vllm.md's;
  ``--namespace-settings ''`` for the server's defaults): one draft call per step, the tree's best
  path as the chain, the request's prompt started, sampled tokens extended, finished when it leaves.

``--replicas R``: a fleet of R vLLM replicas, request n on replica n % R: R independent
``SuffixDecodingCache``s (each sees only its own requests), against R bridges on one shared corpus
namespace. Requests replay one after another (each sees every earlier one's output, in both: in the
fleet, in its replica's cache or the shared corpus); the chain's accepted prefix is its longest
prefix equal to the true next tokens, plus the bonus token. MAT = tokens committed by decode steps /
decode steps (the prefill's token in neither). Deterministic (with the rank model, within the fourth
digit: when a request's own chunks reach the learned corpus varies, docs/ranking.md).

  bash scripts/install_vllm.sh     # arctic-inference into .engines/arctic (vLLM itself is not needed)
  python bench/vllm_pattern.py                   # the greedy shared traces and bench/data/traces, K = 8 and 16
  python bench/vllm_pattern.py --k 16 --trace humaneval164_greedy.jsonl --limit 40
  python bench/vllm_pattern.py --replicas 1 --replicas 4          # and a fleet of 4 replicas
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CorpusServer, load_average, write_report  # noqa: E402
from bench.sglang_pattern import default_traces  # noqa: E402
from bench.traces import REPO, Trace, load_traces  # noqa: E402
from corpus_service.integrations.settings import IntegrationSettings  # noqa: E402
from corpus_service.integrations.vllm import bridge as vllm_bridge  # noqa: E402
from corpus_service.server.config import NamespaceSpec  # noqa: E402

ARCTIC_DIR = REPO / ".engines" / "arctic"
# vLLM 0.33.0's SpeculativeConfig defaults for method "suffix" (vllm/config/speculative.py).
VLLM_SUFFIX = dict(max_tree_depth=24, max_cached_requests=10_000, max_spec_factor=1.0, min_token_prob=0.1)
# The namespace docs/vllm.md launches for vLLM: a chain takes one child per level, so the order of
# siblings is the whole decision, which is what the rank model learns (docs/ranking.md); it drafted
# 1.4-3.6% more MAT here on every trace, for about 2-3 us more draft time per request.
VLLM_NAMESPACE_SETTINGS = "rank_model=true"


def suffix_cache():
    if str(ARCTIC_DIR) not in sys.path:
        sys.path.append(str(ARCTIC_DIR))
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SystemExit(f"arctic-inference is not installed ({e}): run bash scripts/install_vllm.sh") from None
    return SuffixDecodingCache(max_tree_depth=VLLM_SUFFIX["max_tree_depth"],
                               max_cached_requests=VLLM_SUFFIX["max_cached_requests"])


def accepted(chain: list[int], truth: list[int]) -> int:
    a = 0
    while a < len(chain) and a < len(truth) and chain[a] == truth[a]:
        a += 1
    return a


class _Run:
    def __init__(self) -> None:
        self.steps = self.tokens = self.drafted = self.accepted = 0
        self.seconds = 0.0

    def summary(self) -> dict:
        return {"mat": self.tokens / max(self.steps, 1), "steps": self.steps, "tokens": self.tokens,
                "drafted_per_step": self.drafted / max(self.steps, 1),
                "accepted_per_drafted": self.accepted / max(self.drafted, 1),
                "us_per_step": 1e6 * self.seconds / max(self.steps, 1)}


def replay(traces: list[Trace], k: int, propose, finish, replicas: int = 1) -> dict:
    """``propose(replica, rid, ctx, num_prompt, num_tokens, sampled) -> chain``; ``finish(replica, rid)``
    after the last step. Request n runs on replica ``n % replicas`` (dealt round-robin, in order)."""
    run = _Run()
    for n, tr in enumerate(traces):
        out = tr.output_ids
        if len(out) < 2:
            continue
        rid, replica = f"req-{n}", n % replicas
        ctx = np.asarray(tr.prompt_ids + out, dtype=np.int32)  # the runner's token_ids_cpu row
        num_prompt, pos, sampled = len(tr.prompt_ids), 1, out[:1]
        while pos < len(out):
            t0 = time.perf_counter()
            chain = propose(replica, rid, ctx, num_prompt, num_prompt + pos, sampled)
            run.seconds += time.perf_counter() - t0
            a = accepted(chain, out[pos:])
            sampled = out[pos:pos + a + 1]
            pos += len(sampled)
            run.steps += 1
            run.tokens += len(sampled)
            run.drafted += len(chain)
            run.accepted += a
        finish(replica, rid)
    return run.summary()


def replay_suffix(traces: list[Trace], k: int, replicas: int = 1) -> dict:
    """vLLM's own suffix decoding: one ``SuffixDecodingCache`` per replica, each sees only its own requests."""
    caches = [suffix_cache() for _ in range(replicas)]
    depth = VLLM_SUFFIX["max_tree_depth"]

    def propose(replica, rid, ctx, num_prompt, num_tokens, sampled):
        cache = caches[replica]
        if rid not in cache.active_requests:
            cache.start_request(rid, ctx[:num_prompt])
        cache.add_active_response(rid, sampled)
        draft = cache.speculate(rid, ctx[max(0, num_tokens - depth):num_tokens], max_spec_tokens=k,
                                max_spec_factor=VLLM_SUFFIX["max_spec_factor"], min_token_prob=VLLM_SUFFIX["min_token_prob"])
        return draft.token_ids

    return replay(traces, k, propose, lambda replica, rid: caches[replica].stop_request(rid), replicas)


def replay_corpus(traces: list[Trace], k: int, workdir: Path, tree_factor: int, namespace: str = "default",
                  replicas: int = 1) -> dict:
    """The plugin: one corpus server (one namespace), one ``CorpusBridge`` per replica."""
    with CorpusServer(workdir, "--namespace", namespace) as srv:
        # A generous per-call deadline: the replay measures drafts, not this shared host's scheduling.
        bridges = [vllm_bridge.CorpusBridge(IntegrationSettings(srv.target, timeout=30.0)) for _ in range(replicas)]
        vllm_bridge.TREE_BUDGET_FACTOR = tree_factor

        def propose(replica, rid, ctx, num_prompt, num_tokens, sampled):
            b = bridges[replica]
            chains = b.step([vllm_bridge.StepRequest(rid, ctx, num_prompt, num_tokens, k)], {rid})
            if chains is None:
                raise RuntimeError(f"the corpus did not answer: {b.stats.last_error}")
            return chains[0]

        def finish(replica, rid):
            b = bridges[replica]
            b.step([], set())  # the request left the batch: finished at the next call
            b.client.synchronize()  # requests replay one after another: the next sees all of this one

        res = replay(traces, k, propose, finish, replicas)
        res["stats"] = [b.stats.as_dict() for b in bridges]
        for b in bridges:
            b.close()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (repeatable); default: the greedy shared dev traces "
                    "where ../shared exists, and bench/data/traces/*.jsonl")
    ap.add_argument("--k", type=int, action="append", help="num_speculative_tokens (repeatable); default 8 and 16")
    ap.add_argument("--replicas", type=int, action="append", help="vLLM replicas, requests dealt round-robin "
                    "(repeatable; default 1): R SuffixDecodingCaches against one corpus namespace and R bridges")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--tree-factor", type=int, default=vllm_bridge.TREE_BUDGET_FACTOR,
                    help=f"tree nodes the corpus drafts per chain token (default {vllm_bridge.TREE_BUDGET_FACTOR}, the plugin's)")
    ap.add_argument("--namespace-settings", default=VLLM_NAMESPACE_SETTINGS,
                    help=f"the corpus namespace's settings, as in `ngram-corpus serve --namespace default:SETTINGS` "
                    f"(default {VLLM_NAMESPACE_SETTINGS!r}, docs/vllm.md's; '' for the server's defaults)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_pattern.json"))
    args = ap.parse_args(argv)
    ks, replica_counts = args.k or [8, 16], args.replicas or [1]
    if any(k < 1 for k in ks) or args.tree_factor < 1 or any(r < 1 for r in replica_counts):
        ap.error("--k, --replicas and --tree-factor must be >= 1")
    namespace = "default" + (f":{args.namespace_settings}" if args.namespace_settings else "")
    try:
        NamespaceSpec.parse(namespace)  # here, not as a server that fails to start
    except ValueError as e:
        ap.error(f"--namespace-settings: {e}")
    files = [Path(f) for f in args.trace] if args.trace else default_traces()
    res: dict = {"date": time.strftime("%Y-%m-%d"), "suffix_settings": VLLM_SUFFIX, "tree_factor": args.tree_factor,
                 "namespace": namespace, "load_before": load_average(), "runs": []}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-pattern-") as tmp:
        for f in files:
            traces = load_traces(f, args.limit)
            for r, k in ((r, k) for r in replica_counts for k in ks):
                run = {"trace": f.name, "k": k, "replicas": r, "requests": len(traces),
                       "suffix": replay_suffix(traces, k, r),
                       "corpus": replay_corpus(traces, k, Path(tmp) / f"{f.stem}-{k}-{r}", args.tree_factor, namespace, r)}
                run["corpus_vs_suffix"] = run["corpus"]["mat"] / run["suffix"]["mat"]
                cell = f"{f.stem}/K={k}" + (f"/R={r}" if r > 1 else "")
                ratios[cell] = round(run["corpus_vs_suffix"], 4)
                print(f"{cell}: suffix {run['suffix']['mat']:.3f} ({run['suffix']['drafted_per_step']:.1f} drafted/step), "
                      f"corpus {run['corpus']['mat']:.3f} ({run['corpus']['drafted_per_step']:.1f}/step, "
                      f"{run['corpus']['us_per_step']:.0f} us) | {run['corpus_vs_suffix']:.3f}x", flush=True)
                res["runs"].append(run)
    res["load_after"] = load_average()
    summary = {"bench": "vllm_pattern", "tree_factor": args.tree_factor, "namespace": namespace,
               "corpus_vs_suffix": ratios, "min_ratio": min(ratios.values()) if ratios else None, "out": str(args.out)}
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
