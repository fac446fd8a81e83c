"""``bench/rollouts.py replay``: the rollout traces replayed in lockstep, epoch by epoch, on corpora
in process (shared, per replica, without prompt history, the perfect-ranking bound) and with prompt
lookup; each arm's MAT and makespan in rounds per epoch, the run's ratios and summary line."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench.acceptance import BOUND_WIDTH, accept_path, bound_config, prompt_lookup_chain
from bench.common import parse_overrides
from bench.rollouts_common import TRACE_NAMES, Sample, by_epoch, load_samples, trace_path, write_out
from corpus_service import CorpusConfig, NgramCorpus


PHASE_LIVE = 32  # an epoch's bulk: rounds with more live requests than this per replica (the fleet's --phase-live)


class EpochStats:
    """Rounds and tokens of one epoch's requests; with ``phase_live``, the lockstep rounds split into
    the bulk (more than ``phase_live`` requests live in the fleet) and the tail."""

    def __init__(self, phase_live: int = PHASE_LIVE) -> None:
        self.tokens = 0
        self.rounds = 0  # verify rounds summed over requests
        self.longest_rounds = 0  # rounds until the epoch's last request ended (lockstep)
        self.longest_output = 0  # the same without speculation: one token a round
        self.phase_live = phase_live
        self.outputs: list[int] = []
        # phase -> [lockstep rounds, request-rounds, tokens committed]
        self.phases: dict[str, list[int]] = {"bulk": [0, 0, 0], "tail": [0, 0, 0]}

    def round(self, live: int, tokens: int) -> None:
        """One lockstep round with ``live`` requests in the fleet that committed ``tokens``."""
        ph = self.phases["bulk" if live > self.phase_live else "tail"]
        ph[0] += 1
        ph[1] += live
        ph[2] += tokens

    def add(self, out_len: int, rounds: int) -> None:
        self.outputs.append(out_len)
        self.tokens += out_len
        self.rounds += rounds
        self.longest_rounds = max(self.longest_rounds, rounds)
        self.longest_output = max(self.longest_output, out_len)

    def summary(self) -> dict:
        out = {"mat": self.tokens / max(self.rounds, 1), "tokens": self.tokens, "rounds": self.rounds,
               "longest_rounds": self.longest_rounds, "longest_output": self.longest_output,
               "makespan_rounds_vs_no_speculation": self.longest_output / max(self.longest_rounds, 1)}
        if any(ph[0] for ph in self.phases.values()):
            # Without speculation every live request commits one token a round: the bulk lasts until
            # only phase_live requests are left, i.e. the (phase_live + 1)-th longest output.
            lens = sorted(self.outputs, reverse=True)
            none_bulk = lens[self.phase_live] if len(lens) > self.phase_live else 0
            out["phases"] = {name: {"rounds": r, "request_rounds": rr, "tokens": t, "mat": round(t / rr, 3) if rr else None}
                             for name, (r, rr, t) in self.phases.items()}
            out["phases"]["none"] = {"bulk_rounds": none_bulk, "tail_rounds": (lens[0] if lens else 0) - none_bulk}
        return out


def replay_lockstep(samples: list[Sample], engines: list[NgramCorpus], budget: int, *, replicas: int,
                    keys: bool = True, phase_live: int = PHASE_LIVE, tail_budget: int = 0) -> dict[int, EpochStats]:
    """Each epoch's requests at once, sample s on ``engines[(s % replicas) % len(engines)]``. Every
    round drafts each engine's live requests in one batch, then every request commits what it accepted
    (+1); requests whose output is complete finish (into their key's history), then each engine
    applies its pending inserts (deterministic: the next round sees all of this one's). ``tail_budget``
    (0: ``budget``): the draft budget of the tail's rounds (``phase_live`` or fewer live per replica),
    where a small batch makes a deeper tree cheap."""
    out: dict[int, EpochStats] = {}
    for epoch, reqs in by_epoch(samples).items():
        for eng in engines:
            if keys:
                eng.announce_policy_version(epoch)
        stats = EpochStats(phase_live * replicas)  # the fleet's live requests, as the fleet benchmark counts them
        placed: dict[int, list[int]] = defaultdict(list)  # engine -> indices into reqs
        for j, s in enumerate(reqs):
            e = (s.sample % replicas) % len(engines)
            kw = {"prompt_key": s.key, "policy_version": epoch} if keys else {}
            engines[e].start_request(f"e{epoch}r{j}", s.prompt_ids, **kw)
            placed[e].append(j)
        pos = [0] * len(reqs)
        rounds = [0] * len(reqs)
        live = {e: list(js) for e, js in placed.items()}
        while any(live.values()):
            commits: dict[int, list[list[int]]] = {}
            tail = sum(map(len, live.values())) <= phase_live * replicas
            width = tail_budget if tail and tail_budget else budget
            for e, js in live.items():
                if not js:
                    continue
                batch = engines[e].draft([f"e{epoch}r{j}" for j in js], width)
                rows = []
                for row, j in enumerate(js):
                    toks, parents, _ = batch.tree(row)
                    truth = reqs[j].output_ids
                    a = accept_path(toks, parents, truth[pos[j]:pos[j] + width + 1])
                    rows.append(truth[pos[j]:pos[j] + a + 1])
                commits[e] = rows
            stats.round(sum(map(len, live.values())), sum(len(c) for rows in commits.values() for c in rows))
            for e, rows in commits.items():
                js = live[e]
                engines[e].extend_batch([f"e{epoch}r{j}" for j in js], rows)
                for j, c in zip(js, rows):
                    pos[j] += len(c)
                    rounds[j] += 1
            for e, js in live.items():
                for j in js:
                    if pos[j] >= len(reqs[j].output_ids):
                        engines[e].finish(f"e{epoch}r{j}")
                        stats.add(len(reqs[j].output_ids), rounds[j])
                live[e] = [j for j in js if pos[j] < len(reqs[j].output_ids)]
            for eng in engines:
                eng.synchronize()
        out[epoch] = stats
    return out


def replay_prompt_lookup(samples: list[Sample], budget: int) -> dict[int, EpochStats]:
    out: dict[int, EpochStats] = {}
    for epoch, reqs in by_epoch(samples).items():
        stats = EpochStats()
        for s in reqs:
            ctx, i, rounds = list(s.prompt_ids), 0, 0
            while i < len(s.output_ids):
                chain = prompt_lookup_chain(ctx, budget)
                a = accept_path(chain, list(range(-1, len(chain) - 1)), s.output_ids[i:])
                commit = s.output_ids[i:i + a + 1]
                ctx.extend(commit)
                i += len(commit)
                rounds += 1
            stats.add(len(s.output_ids), rounds)
        out[epoch] = stats
    return out


def arm_result(per_epoch: dict[int, EpochStats], score_epochs: list[int], seconds: float,
               engines: list[NgramCorpus] | None = None) -> dict:
    scored = EpochStats()
    for e in score_epochs:
        st = per_epoch[e]
        scored.tokens += st.tokens
        scored.rounds += st.rounds
    res = {"mat": scored.tokens / max(scored.rounds, 1), "epochs": {str(e): st.summary() for e, st in per_epoch.items()},
           "seconds": round(seconds, 2)}
    if engines is not None:
        stats = [eng.stats() for eng in engines]
        res["history"] = {k: sum(s[k] for s in stats) for k in
                          ("history_keys", "history_rollouts", "history_tokens", "history_bytes",
                           "history_rollouts_dropped", "history_keys_evicted", "learned_tokens")}
        res["history"]["history_bytes_per_token"] = res["history"]["history_bytes"] / max(res["history"]["history_tokens"], 1)
        res["source_weights"] = {k.removeprefix("source_").removesuffix("_weight"): round(float(stats[0][k]), 4)
                                 for k in stats[0] if k.startswith("source_") and k.endswith("_weight")}
    return res


def run_replay(args: argparse.Namespace) -> dict:
    config = CorpusConfig(**parse_overrides(args.set))
    results: dict = {"mode": "replay", "replicas": args.replicas, "budget": args.budget, "tail_budget": args.tail_budget,
                     "date": time.strftime("%Y-%m-%d", time.gmtime()), "runs": []}
    lines = []
    for name in args.trace or TRACE_NAMES:
        path = trace_path(name)
        samples = load_samples(path, args.prompts, args.epochs)
        epochs = sorted({s.epoch for s in samples})
        score = [e for e in epochs if e >= 1] or epochs  # epochs 1.. have earlier epochs' history
        run: dict = {"trace": path.name, "requests": len(samples), "prompts": len({s.key for s in samples}),
                     "epochs": epochs, "scored_epochs": score, "arms": {}}
        arms = {
            "shared": (lambda: [NgramCorpus(config)], True),
            "local": (lambda: [NgramCorpus(config) for _ in range(args.replicas)], True),
            "no_history": (lambda: [NgramCorpus(config.replace(history_max_bytes=0))], True),
            # The "4 local corpora, groups" column: per-replica corpora before prompt history.
            "local_no_history": (lambda: [NgramCorpus(config.replace(history_max_bytes=0))
                                          for _ in range(args.replicas)], True),
        }
        default_arms = ("shared", "local", "no_history", "prompt_lookup")
        if args.bound:
            bc = bound_config(config, args.budget)
            arms["bound_shared"] = (lambda: [NgramCorpus(bc)], True)
            arms["bound_local"] = (lambda: [NgramCorpus(bc) for _ in range(args.replicas)], True)
        for arm, (make, keys) in arms.items():
            if arm not in (args.arms or default_arms + (("bound_shared", "bound_local") if args.bound else ())):
                continue
            t0 = time.perf_counter()
            engines = make()
            width = BOUND_WIDTH if arm.startswith("bound") else args.budget
            per_epoch = replay_lockstep(samples, engines, width, replicas=args.replicas, keys=keys,
                                        phase_live=args.phase_live, tail_budget=0 if arm.startswith("bound") else args.tail_budget)
            run["arms"][arm] = arm_result(per_epoch, score, time.perf_counter() - t0, engines)
            print(f"  {path.stem} {arm}: MAT {run['arms'][arm]['mat']:.3f} (epochs "
                  + ", ".join(f"{e}: {st['mat']:.3f}" for e, st in run["arms"][arm]["epochs"].items())
                  + f") {run['arms'][arm]['seconds']:.1f} s", flush=True)
        if not args.arms or "prompt_lookup" in args.arms:
            t0 = time.perf_counter()
            run["arms"]["prompt_lookup"] = arm_result(replay_prompt_lookup(samples, args.budget), score,
                                                      time.perf_counter() - t0)
        a = run["arms"]
        ratios = {}
        if "shared" in a and "local" in a:
            ratios["shared_over_local"] = a["shared"]["mat"] / a["local"]["mat"]
        if "shared" in a and "no_history" in a:
            ratios["shared_over_no_history"] = a["shared"]["mat"] / a["no_history"]["mat"]
        if "shared" in a and "prompt_lookup" in a:
            ratios["shared_over_prompt_lookup"] = a["shared"]["mat"] / a["prompt_lookup"]["mat"]
        if "bound_shared" in a and "bound_local" in a:
            ratios["bound_shared_over_local"] = a["bound_shared"]["mat"] / a["bound_local"]["mat"]
        run["ratios"] = ratios
        results["runs"].append(run)
        line = f"{path.stem} R={args.replicas} B={args.budget} epochs {','.join(map(str, score))}:"
        for arm in ("shared", "local", "no_history", "local_no_history", "prompt_lookup", "bound_shared", "bound_local"):
            if arm in a:
                rounds = ", ".join(f"{a[arm]['epochs'][str(e)]['makespan_rounds_vs_no_speculation']:.2f}x" for e in score)
                line += f" {arm} {a[arm]['mat']:.3f} (rounds {rounds})"
        line += " | " + " ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        print(line, flush=True)
        lines.append(line)
    write_out(args.out, results)
    print("SUMMARY rollouts replay: " + " || ".join(lines) + f" -> {args.out}")
    return results
