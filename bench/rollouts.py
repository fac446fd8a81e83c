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
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.acceptance import BOUND_WIDTH, accept_path, bound_config, prompt_lookup_chain  # noqa: E402
from bench.fleet_stats import add_counters, fetch_text, phase_stats, replica_metrics  # noqa: E402
from bench.traces import shared_data_dir  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402

TRACE_NAMES = ("rollouts_dev_g8e3.jsonl", "rollouts_dev_g8e3_t07.jsonl")
# Slices of the rollout traces shipped with the repository (bench/data/README.md): the replay's
# input where the shared data folder is absent (a fresh clone, CI).
SLICE_DIR = REPO / "bench" / "data" / "traces"
SLICES = {"rollouts_dev_g8e3.jsonl": "rollouts_dev_g8e3_slice4.jsonl",
          "rollouts_dev_g8e3_t07.jsonl": "rollouts_dev_g8e3_t07_slice4.jsonl"}
# The traces' policy perturbation (../shared/data/README.md): sigma * std(W) on every linear weight.
NOISE_SIGMA = 0.014075


@dataclass(frozen=True, slots=True)
class Sample:
    """One rollout of the trace: sample ``sample`` of prompt ``key`` in epoch ``epoch``."""

    key: str
    epoch: int
    sample: int
    category: str
    temperature: float
    prompt_ids: list[int]
    output_ids: list[int]


def trace_path(name: str) -> Path:
    """A rollout trace: a path as given, else the shared data folder's, else the repository's slice."""
    p = Path(name)
    if p.exists():
        return p
    shared = shared_data_dir() / "traces" / p.name
    if shared.exists():
        return shared
    if p.name in SLICES and (SLICE_DIR / SLICES[p.name]).exists():
        return SLICE_DIR / SLICES[p.name]
    raise FileNotFoundError(f"rollout trace not found: {name} (nor {shared}, nor a shipped slice)")


def load_samples(path: Path, prompts: int | None = None, epochs: int | None = None) -> list[Sample]:
    """The trace's rows, the first ``prompts`` prompt keys (in order of appearance) and epochs < ``epochs``."""
    out: list[Sample] = []
    keys: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for field in ("prompt_key", "epoch", "sample", "prompt_ids", "output_ids"):
                if field not in r:
                    raise ValueError(f"{path}: a row without '{field}': not a rollout trace")
            key = str(r["prompt_key"])
            if key not in keys:
                if prompts is not None and len(keys) >= prompts:
                    continue
                keys[key] = len(keys)
            if epochs is not None and int(r["epoch"]) >= epochs:
                continue
            out.append(Sample(key, int(r["epoch"]), int(r["sample"]), str(r.get("category", "all")),
                              float(r.get("temperature", 1.0)), list(r["prompt_ids"]), list(r["output_ids"])))
    if not out:
        raise ValueError(f"{path}: no rollouts selected")
    return out


def by_epoch(samples: list[Sample]) -> dict[int, list[Sample]]:
    epochs: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        epochs[s.epoch].append(s)
    return dict(sorted(epochs.items()))


# ---------------------------------------------------------------------------------------------- replay


class EpochStats:
    """Rounds and tokens of one epoch's requests."""

    def __init__(self) -> None:
        self.tokens = 0
        self.rounds = 0  # verify rounds summed over requests
        self.longest_rounds = 0  # rounds until the epoch's last request ended (lockstep)
        self.longest_output = 0  # the same without speculation: one token a round

    def add(self, out_len: int, rounds: int) -> None:
        self.tokens += out_len
        self.rounds += rounds
        self.longest_rounds = max(self.longest_rounds, rounds)
        self.longest_output = max(self.longest_output, out_len)

    def summary(self) -> dict:
        return {"mat": self.tokens / max(self.rounds, 1), "tokens": self.tokens, "rounds": self.rounds,
                "longest_rounds": self.longest_rounds, "longest_output": self.longest_output,
                "makespan_rounds_vs_no_speculation": self.longest_output / max(self.longest_rounds, 1)}


def replay_lockstep(samples: list[Sample], engines: list[NgramCorpus], budget: int, *, replicas: int,
                    keys: bool = True) -> dict[int, EpochStats]:
    """Each epoch's requests at once, sample s on ``engines[(s % replicas) % len(engines)]``. Every
    round drafts each engine's live requests in one batch, then every request commits what it accepted
    (+1); requests whose output is complete finish (into their key's history), then each engine
    applies its pending inserts (deterministic: the next round sees all of this one's)."""
    out: dict[int, EpochStats] = {}
    for epoch, reqs in by_epoch(samples).items():
        for eng in engines:
            if keys:
                eng.announce_policy_version(epoch)
        stats = EpochStats()
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
            for e, js in live.items():
                if not js:
                    continue
                batch = engines[e].draft([f"e{epoch}r{j}" for j in js], budget)
                rows = []
                for row, j in enumerate(js):
                    toks, parents, _ = batch.tree(row)
                    truth = reqs[j].output_ids
                    a = accept_path(toks, parents, truth[pos[j]:pos[j] + budget + 1])
                    rows.append(truth[pos[j]:pos[j] + a + 1])
                commits[e] = rows
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
    results: dict = {"mode": "replay", "replicas": args.replicas, "budget": args.budget,
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
            per_epoch = replay_lockstep(samples, engines, width, replicas=args.replicas, keys=keys)
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


# ---------------------------------------------------------------------------------------------- memory


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


# ---------------------------------------------------------------------------------------------- fleet


class Proc:
    """A server process with its port read back from a ports file."""

    def __init__(self, cmd: list[str], ports_file: Path, log_path: Path, env: dict | None = None) -> None:
        self.ports_file = ports_file
        self.log_path = log_path
        ports_file.unlink(missing_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def ports(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ports_file.exists() or not self.ports_file.read_text().strip():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.proc.args[:4]} did not start within {timeout} s:\n{self.tail()}")
            time.sleep(0.1)
        time.sleep(0.05)  # the file is written whole; a partial read retries below
        try:
            return json.loads(self.ports_file.read_text())
        except json.JSONDecodeError:
            time.sleep(0.5)
            return json.loads(self.ports_file.read_text())

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_corpus(work: Path, token: str, namespace: str) -> tuple[Proc, str]:
    data = work / "corpus"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
           "--admin-port", "0", "--data-dir", str(data), "--ports-file", str(work / "corpus-ports.json"),
           "--admin-token", token, "--namespace", namespace]
    p = Proc(cmd, work / "corpus-ports.json", work / "corpus.log")
    ports = p.ports(60)
    return p, f"127.0.0.1:{ports['grpc_port']}"


def verifier_cmd(args: argparse.Namespace, corpus: str, ports_file: Path, token: str) -> list[str]:
    """A replica with epoch 0's policy; later epochs' weights come through POST /v1/update-weights."""
    cmd = [sys.executable, "-m", "verifier", "serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--port", "0", "--ports-file", str(ports_file), "--corpus", corpus,
           "--max-batch", str(args.max_batch), "--max-len", str(args.max_len), "--max-budget", str(args.budget),
           "--allow-weight-updates", "true", "--allow-policy-version", "true", "--admin-key", VERIFIER_ADMIN_KEY]
    if corpus not in ("local", "none"):
        cmd += ["--corpus-token", token]
    if args.device.startswith("cuda"):
        # The replicas share the one GPU: a tree's extra forward time delays all of them (verifier
        # --gpu-share; docs/rollouts.md). A --verifier-arg=--gpu-share=N overrides it.
        cmd += ["--gpu-share", str(args.replicas)]
    if args.noise_sigma > 0:
        cmd += ["--weight-noise-sigma", repr(args.noise_sigma), "--weight-noise-seed", str(noise_seed(args, 0))]
    return cmd + list(args.verifier_arg)  # last: they override the above


# The replicas' admin credential: /v1/update-weights and /v1/policy-version answer only it (verifier/api/admin.py).
VERIFIER_ADMIN_KEY = "rollouts-bench-verifier-admin-key"


def noise_seed(args: argparse.Namespace, epoch: int) -> int:
    return args.noise_seed_base + args.noise_seed_stride * epoch


async def new_policy(urls: list[str], args: argparse.Namespace, epoch: int, announce: bool) -> float:
    """Epoch ``epoch``'s weights into every replica at once (each drains its requests, none run between
    epochs) and, with ``announce``, its policy version to their corpora; returns the seconds it took."""
    body: dict = {"weight_noise_sigma": args.noise_sigma, "weight_noise_seed": noise_seed(args, epoch)}
    if announce:
        body["policy_version"] = epoch
    return await post_all(urls, "/v1/update-weights", body, args.start_timeout_s)


async def post_all(urls: list[str], route: str, body: dict, timeout: float) -> float:
    """``body`` to ``route`` of every replica at once; RuntimeError unless all answer 200; the seconds."""
    import httpx

    t = time.perf_counter()
    admin = {"Authorization": f"Bearer {VERIFIER_ADMIN_KEY}"}  # (both routes it posts to are admin routes)
    async with httpx.AsyncClient(timeout=timeout) as http:
        rs = await asyncio.gather(*(http.post(u + route, json=body, headers=admin) for u in urls))
    for u, r in zip(urls, rs):
        if r.status_code != 200:
            raise RuntimeError(f"{u}{route}: HTTP {r.status_code}: {r.text[:500]}")
    return time.perf_counter() - t


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


async def announce_version(urls: list[str], epoch: int) -> float:
    """``POST /v1/policy-version`` on every replica (their corpora: one service, or each its own)."""
    return await post_all(urls, "/v1/policy-version", {"version": epoch}, 60.0)


def wait_healthy(urls: list[str], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                if httpx.get(u + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{u}/healthz not ready within {timeout} s")
            time.sleep(0.2)


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


# ---------------------------------------------------------------------------------------------- main


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set: expected FIELD=VALUE, got {kv!r}")
        out[k] = json.loads(v) if v[:1] in "[{0123456789-.tf" else v
        if isinstance(out[k], list):
            out[k] = tuple(out[k])
    return out


def write_out(path: str, results: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))


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
        return run_replay(args)
    if args.mode == "memory":
        return run_memory(args)
    return run_fleet(args)


if __name__ == "__main__":
    main()
