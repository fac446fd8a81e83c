"""The SGLang plugin against SGLang's own corpus, both driven exactly as SGLang's NGRAM worker drives
its corpus (``bench.sglang_pattern.replay_sglang``: 18-token windows, ``synchronize``, ``batch_get``,
``batch_put``, ``erase_match_state``; SGLang's server defaults), in one run:

- ``sglang``: SGLang 0.5.23's real ``NgramCorpus`` (its JIT-compiled C++ trie), from the pinned
  release in ``.engines/sglang`` (scripts/install_sglang.sh);
- ``plugin``: the class the plugin puts in its place (``SharedNgramCorpus``), drafting from a corpus
  service on 127.0.0.1 started here (a fresh namespace per run, the service's default mode);
- ``plugin_prompts``: the same, told each request's prompt before it drafts, as the plugin's worker
  hook tells it (prompt keys: the samples of one prompt share a history).

MAT = tokens committed by decode steps / decode steps. The ratio is plugin / sglang, per trace and K.

  python3 bench/sglang_plugin.py                          # default traces, K = 16 and 8
  python3 bench/sglang_plugin.py --k 16 --limit 20 --trace bench/data/traces/humaneval164_t07x4.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO / ".engines" / "sglang"
sys.path.insert(0, str(REPO))
if (ENGINE_DIR / "sglang").is_dir() and str(ENGINE_DIR) not in sys.path:
    sys.path.insert(1, str(ENGINE_DIR))  # the pinned SGLang, never the venv's own packages

from bench.common import CorpusServer, write_report  # noqa: E402
from bench.sglang_pattern import SGLANG_ARGS, replay_sglang  # noqa: E402
from bench.traces import load_traces, shared_data_dir  # noqa: E402

NAMES = ("sglang", "plugin", "plugin_prompts")


def default_traces() -> list[Path]:
    """The shared folder's greedy dev traces (where present) and the repository's sampled ones."""
    shared = sorted((shared_data_dir() / "traces").glob("*_greedy.jsonl"))
    repo = [REPO / "bench" / "data" / "traces" / n for n in ("humaneval164_t07x4.jsonl", "specbench_dev120_t07x4.jsonl")]
    return shared + repo


class WithPrompts:
    """What the plugin's worker hook does before each draft: the corpus learns each request's prompt."""

    def __init__(self, corpus, prompts: dict[str, list[int]]) -> None:
        self.corpus, self.prompts = corpus, prompts

    def batch_get(self, req_ids, batch_tokens, total_lens):
        self.corpus.note_prompts((r, self.prompts[r]) for r in req_ids)
        return self.corpus.batch_get(req_ids, batch_tokens, total_lens)

    def __getattr__(self, name):
        return getattr(self.corpus, name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (repeatable); default: see the docstring")
    ap.add_argument("--k", type=int, action="append", help="draft_token_num (repeatable); default 16 and 8")
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoding together (default 1)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sglang_plugin.json"))
    args = ap.parse_args(argv)
    try:
        import sglang.srt.speculative.cpp_ngram.ngram_corpus as sglang_corpus
    except ImportError as e:
        ap.error(f"SGLang is not importable ({e}): bash scripts/install_sglang.sh")
    from corpus_service.integrations.sglang.compat import sglang_version
    from corpus_service.integrations.sglang.corpus import SharedNgramCorpus

    ks = args.k or [16, 8]
    files = [Path(f) for f in args.trace] if args.trace else default_traces()
    runs = [(f, k) for f in files for k in ks]
    spaces = [f"run{i}p{p}" for i in range(len(runs)) for p in (0, 1)]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "sglang_version": sglang_version(),
                 "concurrency": args.concurrency, "runs": []}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = CorpusServer(tmp, *[a for s in spaces for a in ("--namespace", s)], "--max-budget", "64")
        srv.start()
        os.environ["NGRAM_CORPUS_TARGET"] = srv.target
        os.environ["NGRAM_CORPUS_TIMEOUT"] = "10"  # a benchmark measures drafts, not deadlines
        try:
            for i, (f, k) in enumerate(runs):
                traces = load_traces(f, args.limit)
                prompts = {f"req-{j}": list(tr.prompt_ids) for j, tr in enumerate(traces)}
                run: dict = {"trace": f.name, "k": k, "requests": len(traces)}
                real = sglang_corpus.NgramCorpus(draft_token_num=k, match_type="BFS", **SGLANG_ARGS)
                run["sglang"] = replay_sglang(traces, real, k, concurrency=args.concurrency)
                for p, name in enumerate(NAMES[1:]):
                    os.environ["NGRAM_CORPUS_NAMESPACE"] = f"run{i}p{p}"
                    corpus = SharedNgramCorpus(draft_token_num=k, match_type="BFS", **SGLANG_ARGS)
                    driven = WithPrompts(corpus, prompts) if name == "plugin_prompts" else corpus
                    run[name] = replay_sglang(traces, driven, k, concurrency=args.concurrency)
                    run[name]["corpus_stats"] = corpus.stats()
                    corpus.close()
                for name in NAMES[1:]:
                    run[f"{name}_vs_sglang"] = run[name]["mat"] / run["sglang"]["mat"]
                    ratios[f"{f.stem}/K={k}/{name}"] = round(run[f"{name}_vs_sglang"], 4)
                print(f"{f.stem} K={k}: " + ", ".join(f"{n} {run[n]['mat']:.3f}" for n in NAMES)
                      + f" | plugin / sglang {run['plugin_vs_sglang']:.3f}x, with prompts "
                      f"{run['plugin_prompts_vs_sglang']:.3f}x", flush=True)
                res["runs"].append(run)
        finally:
            srv.stop()
    summary = {"bench": "sglang_plugin", "sglang_version": res["sglang_version"], "concurrency": args.concurrency,
               "mat": {f"{r['trace'].removesuffix('.jsonl')}/K={r['k']}": {n: round(r[n]["mat"], 3) for n in NAMES}
                       for r in res["runs"]},
               "vs_sglang": ratios, "min_ratio": min(ratios.values()) if ratios else None, "out": str(args.out)}
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
