"""RL rollouts: every sample of a prompt drafts from all of the prompt's earlier rollouts, epoch after
epoch, across replicas (issue 30).

Three modes:

``replay`` (CPU; CI runs it at smoke scale): the rollout traces (``rollouts_dev_g8e3*.jsonl``: G
samples per prompt and epoch, a perturbed policy each epoch) replayed in lockstep. Each epoch all of
its requests run at once, in rounds: every round drafts a tree for every live request (budget B),
accepts the longest tree path equal to the trace's next output tokens, commits it plus the bonus
token; a request ends with its trace output. Sample s of a prompt is served by replica s % R. Arms,
same run, same traces:
  - ``shared``: one corpus for all R replicas, requests started with their prompt key and policy
    version (the epoch; announced when an epoch begins): the key's live samples are one group
    (they draft from each other at once) and its finished rollouts, of this and earlier epochs, are
    its prompt history;
  - ``local``: R corpora, one per replica, each with the same prompt keys and versions (so each keeps
    the history of what its own replica served: one engine's view, as in-engine rollout caches have);
  - ``no_history``: ``shared`` with the prompt history off (``history_max_bytes=0``): groups and the
    learned corpus only; ``local_no_history`` (on request): ``local`` without it;
  - ``prompt_lookup``: each request drafts from its own context alone (n-gram suffix match, a chain);
  - ``--bound``: the perfect-ranking bound of the shared and local corpora (``bench/acceptance.py``):
    every candidate the engine finds kept to depth B at any width, so no ordering of the engine's
    evidence accepts more with B nodes.
  Per arm and epoch: MAT (output tokens / verify rounds summed over requests) and the epoch's
  makespan in rounds: the longest output (rounds without speculation) over the rounds until the
  epoch's last request ends.

``fleet`` (GPU): one corpus service and R ``ngram-verifier serve`` replicas on one GPU, a GRPO
schedule: each epoch every prompt x G samples over ``/v1/completions`` (one request per sample,
seeded; sample s to replica s % R) with the extension fields ``prompt_key`` and ``policy_version``;
the replicas start once per arm (epoch 0's policy: ``--weight-noise-sigma S --weight-noise-seed N``)
and between epochs the policy changes in place, as an RL trainer pushes new weights: ``POST
/v1/update-weights`` with epoch e's seed and ``policy_version`` e, which also reaches the corpus
(``AnnouncePolicyVersion``). Per epoch: makespan (first request sent to last answer), output tokens/s
and MAT (the answers' usage). Arms: ``shared`` (every replica drafts from the corpus service),
``local`` (each replica its embedded corpus, kept across epochs: the history of what its own replica
served, as an engine-local rollout cache has), ``none`` (``--corpus none``: no speculation).

``memory``: a synthetic prompt history (default 10,000 prompts x 8 samples x 300 output tokens plus
the stored prompt tail, random tokens: nothing shared, the index's worst case) added to one corpus;
reports the engine's own accounting (``history_bytes_per_token``, against the 48 B bound of
``worst_case_history_bytes_per_token``), whether all of it fits ``history_max_bytes`` without an
eviction, and the process RSS growth.

    python bench/rollouts.py replay                      # both dev rollout traces, R=4, B=15
    python bench/rollouts.py replay --bound              # + the perfect-ranking bound (minutes)
    python bench/rollouts.py replay --prompts 3          # smoke scale (the shipped slices fit)
    python bench/rollouts.py memory                      # 10k x 8 x 300 history: bytes/token, RSS
    python bench/rollouts.py fleet --replicas 4 --samples 8 --epochs 3 --temperature 0.7   # on a GPU
    python bench/rollouts.py fleet --arms shared --out s.json; ... ; python bench/rollouts.py fleet-merge s.json l.json n.json

Summary lines start with ``SUMMARY rollouts``; the full results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# This file is the command line; each mode lives beside it: bench/rollouts_common.py (the traces and
# what the modes share), bench/rollouts_replay.py, bench/rollouts_memory.py, bench/rollouts_fleet.py
# (fleet and fleet-merge), bench/fleet_replicas.py (the fleet's processes and admin posts) and
# bench/fleet_stats.py (the fleet's replica counters). The names below are also read as
# ``bench.rollouts.X`` (tests/bench/test_rollouts.py).
from bench.fleet_replicas import VERIFIER_ADMIN_KEY, noise_seed, verifier_cmd  # noqa: E402,F401
from bench.fleet_stats import phase_stats  # noqa: E402,F401
from bench.rollouts_common import NOISE_SIGMA, SLICES, TRACE_NAMES, load_samples, trace_path  # noqa: E402,F401
from bench.rollouts_fleet import run_fleet, run_fleet_merge  # noqa: E402
from bench.rollouts_memory import run_memory  # noqa: E402
from bench.rollouts_replay import run_replay  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    rp = sub.add_parser("replay", help="lockstep replay of the rollout traces (CPU)")
    rp.add_argument("--trace", action="append", help="rollout trace (repeatable); default: both dev traces")
    rp.add_argument("--replicas", type=int, default=4)
    rp.add_argument("--budget", type=int, default=15)
    rp.add_argument("--prompts", type=int, default=None, help="the first N prompt keys of each trace")
    rp.add_argument("--epochs", type=int, default=None, help="the first N epochs")
    rp.add_argument("--arms", nargs="*", default=None,
                    help="shared local no_history local_no_history prompt_lookup bound_shared bound_local (default: "
                         "shared local no_history prompt_lookup, and the bound's two with --bound)")
    rp.add_argument("--bound", action="store_true", help="also the perfect-ranking bound of shared and local")
    rp.add_argument("--tail-budget", type=int, default=0, help="draft budget of the tail's rounds (0: --budget): "
                    "deeper drafts for an epoch's last requests")
    rp.add_argument("--phase-live", type=int, default=32, help="an epoch's bulk: lockstep rounds with more live "
                    "requests than this per replica (as fleet's); the rest is its tail (rounds, MAT, tokens per epoch)")
    rp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="CorpusConfig override")
    rp.add_argument("--out", default=str(REPO / "bench" / "results" / "rollouts_replay.json"))
    mp = sub.add_parser("memory", help="bytes per stored history token, synthetic 10k x 8 x 300 history")
    mp.add_argument("--prompts", type=int, default=10_000)
    mp.add_argument("--samples", type=int, default=8)
    mp.add_argument("--tokens", type=int, default=300, help="output tokens per rollout")
    mp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="CorpusConfig override")
    mp.add_argument("--out", default=str(REPO / "bench" / "results" / "rollouts_memory.json"))
    fp = sub.add_parser("fleet", help="R verifier replicas and one corpus service on one GPU, GRPO epochs")
    fp.add_argument("--trace", action="append", help="the rollout trace whose prompts (and keys) to serve; "
                    "default: rollouts_dev_g8e3_t07.jsonl")
    fp.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all 67)")
    fp.add_argument("--replicas", type=int, default=4)
    fp.add_argument("--samples", type=int, default=8, help="G: samples per prompt and epoch")
    fp.add_argument("--epochs", type=int, default=3)
    fp.add_argument("--temperature", type=float, default=0.7)
    fp.add_argument("--max-tokens", type=int, default=384)
    fp.add_argument("--budget", type=int, default=15, help="the replicas' --max-budget")
    fp.add_argument("--model", default="smollm2")
    fp.add_argument("--device", default="cuda")
    fp.add_argument("--dtype", default="bfloat16")
    fp.add_argument("--max-batch", type=int, default=160, help="each replica's --max-batch")
    fp.add_argument("--max-len", type=int, default=1024)
    fp.add_argument("--namespace", default="smollm2:vocab=49152,tokenizer=smollm2",
                    help="the corpus service's namespace (--namespace of its serve)")
    fp.add_argument("--noise-sigma", type=float, default=NOISE_SIGMA,
                    help="policy change per epoch: --weight-noise-sigma of the replicas (0: no perturbation)")
    fp.add_argument("--noise-seed-base", type=int, default=0,
                    help="epoch e's --weight-noise-seed is BASE + STRIDE * e (20251202 and 1000: the traces' seeds)")
    fp.add_argument("--noise-seed-stride", type=int, default=1)
    fp.add_argument("--seed", type=int, default=0, help="sampling seeds of the requests derive from it")
    fp.add_argument("--arms", nargs="*", default=None, help="shared local none (default: all three)")
    fp.add_argument("--no-history-fields", action="store_true",
                    help="send no prompt_key/policy_version (a verifier without the extension fields)")
    fp.add_argument("--verifier-arg", action="append", default=[], help="an extra flag for every replica (repeatable)")
    fp.add_argument("--phase-live", type=int, default=32,
                    help="live requests per replica above which an epoch is in its bulk phase (its tail after)")
    fp.add_argument("--start-timeout-s", type=float, default=600.0)
    fp.add_argument("--request-timeout-s", type=float, default=1800.0)
    fp.add_argument("--out", default=str(REPO / "bench" / "results" / "rollouts_fleet.json"))
    mg = sub.add_parser("fleet-merge", help="merge fleet results run arm by arm into one (same schedule)")
    mg.add_argument("inputs", nargs="+", help="fleet JSON results")
    mg.add_argument("--out", default=str(REPO / "bench" / "results" / "rollouts_fleet.json"))
    args = ap.parse_args(argv)
    if args.mode == "fleet-merge":
        return run_fleet_merge(args)
    if args.mode == "replay":
        if args.tail_budget < 0 or args.phase_live < 0:
            ap.error("--tail-budget and --phase-live: expected >= 0")
        return run_replay(args)
    if args.mode == "memory":
        return run_memory(args)
    return run_fleet(args)


if __name__ == "__main__":
    main()
