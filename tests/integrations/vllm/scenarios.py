"""What the vLLM tests run in a process of their own, with vLLM 0.33.0 on its path (engine.py):
each scenario starts a real corpus server on 127.0.0.1, loads the plugin through vLLM's own
``load_general_plugins()``, builds vLLM's ``SuffixDecodingProposer`` (imported from vLLM's module,
now the plugin's subclass) and drives it with vLLM's real ``InputBatch`` as the runner does. It
prints one ``RESULT {json}`` line of observations; the tests assert on them.

  python -m tests.integrations.vllm.scenarios proposer|outage|tp|loader|runner WORKDIR
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import CorpusServer
from corpus_service.client import CorpusClient
from tests.integrations.vllm.runner_batch import RunnerBatch, proposer_config

K = 8
RNG = np.random.default_rng(42)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def tokens(n: int) -> list[int]:
    return [int(t) for t in RNG.choice(np.arange(1000, 40_000), size=n, replace=False)]


def load(target: str, retry: str = "0.5") -> tuple[str, type, type, Lines]:
    """The plugin through vLLM's loader; (its line, the class vLLM's module now names, vLLM's own, logs)."""
    os.environ.update(NGRAM_CORPUS_TARGET=target, NGRAM_CORPUS_TIMEOUT="5", NGRAM_CORPUS_RETRY_SECONDS=retry)
    lines = Lines()
    logging.getLogger("corpus_service.integrations.vllm").addHandler(lines)
    logging.getLogger("corpus_service.integrations.vllm").setLevel(logging.INFO)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # vLLM loads plugins in several places of one process
    import corpus_service.integrations.vllm as plugin
    from vllm.v1.spec_decode import suffix_decoding

    patched = suffix_decoding.SuffixDecodingProposer
    return plugin.last_outcome, patched, getattr(patched, "__ngram_corpus_base__", patched), lines


def teach(target: str, rid: str, prompt: list[int], output: list[int]) -> None:
    """Another replica's request, through the project's client: the shared corpus learns ``output``."""
    with CorpusClient(target, timeout=10) as c:
        c.start_request(rid, prompt)
        c.extend(rid, output)
        c.finish(rid)
        c.synchronize()


def chain_of(target: str, context: list[int], k: int = K) -> list[int]:
    """What the corpus drafts after ``context`` for a new request of another replica."""
    from corpus_service.integrations.vllm.bridge import best_chain

    with CorpusClient(target, timeout=10) as c:
        c.synchronize()
        c.start_request("probe", context)
        chain = best_chain(c.draft(["probe"], 2 * k), 0, k)
        c.finish("probe", rollout=False)
        c.flush()
        return chain


def decode(proposer, rb: RunnerBatch, req_id: str, truth: list[int], others=(), max_steps: int = 1000) -> dict:
    """Decodes ``req_id`` to the end of ``truth`` as vLLM's rejection sampler would with greedy
    drafts checked against the true tokens: each step commits the accepted draft prefix plus one
    token. ``others``: proposers fed the same batch (vLLM's own, a reference)."""
    pos, steps, drafts_seen, other_drafts = 1, 0, [], []
    sampled = rb.sample({req_id: truth[:1]})  # the prefill's token
    while True:
        row = rb.batch.req_id_to_index[req_id]
        drafts = proposer.propose(K, rb.batch, sampled)
        other_drafts.append([o.propose(K, rb.batch, sampled)[row] for o in others])
        d = drafts[row]
        drafts_seen.append(d)
        steps += 1
        if pos >= len(truth) or steps >= max_steps:
            break
        a = 0
        while a < len(d) and pos + a < len(truth) and d[a] == truth[pos + a]:
            a += 1
        commit = truth[pos:pos + a + 1]
        pos += len(commit)
        sampled = rb.sample({req_id: commit})
    return {"steps": steps, "tokens": len(truth), "drafts": drafts_seen, "others": other_drafts}


def scenario_proposer(workdir: Path) -> dict:
    with CorpusServer(workdir / "corpus", "--namespace", "default") as srv:
        line, cls, base, logs = load(srv.target)
        shared = tokens(60)
        teach(srv.target, "replica2-req", tokens(20), shared)
        cfg = proposer_config(K)
        proposer, vanilla = cls(cfg), base(cfg)
        rb = RunnerBatch(k=K)
        own = tokens(30)  # this request's own continuation: nobody taught it
        truth = shared[:20] + own
        rb.add("req-b", tokens(20))
        run = decode(proposer, rb, "req-b", truth, others=[vanilla])
        rb.remove("req-b")
        rb.add("req-c", tokens(10))  # the next step tells the corpus that req-b left the batch
        proposer.propose(K, rb.batch, rb.sample({"req-c": [7]}))
        learned = chain_of(srv.target, own[:6])
        return {"line": line, "subclass": issubclass(cls, base) and cls is not base, "first_draft": run["drafts"][0],
                "shared": shared, "own": own, "vanilla_first": run["others"][0][0], "steps": run["steps"],
                "tokens": run["tokens"], "learned_chain": learned, "stats": proposer.bridge.stats.as_dict(),
                "logs": logs.lines}


def scenario_outage(workdir: Path) -> dict:
    srv = CorpusServer(workdir / "corpus", "--namespace", "default").start()
    try:
        line, cls, base, logs = load(srv.target)
        cfg = proposer_config(K)
        proposer, vanilla = cls(cfg), base(cfg)
        rb = RunnerBatch(k=K)
        x = tokens(40)
        rb.add("req-o", x + x)  # vLLM's own prompt tree drafts x's continuation
        up = decode(proposer, rb, "req-o", x[:12], others=[vanilla])
        port = srv.grpc_port
        srv.kill()
        down = decode(proposer, rb, "req-o", x[12:30], others=[vanilla])
        down_stats = proposer.bridge.stats.as_dict()
        srv.start(grpc_port=port)
        t0, back_after = time.monotonic(), None
        before = proposer.bridge.stats.corpus_steps
        while time.monotonic() - t0 < 30:
            proposer.propose(K, rb.batch, rb.sample({"req-o": [x[30]]}))
            if proposer.bridge.stats.corpus_steps > before:
                back_after = time.monotonic() - t0
                break
            time.sleep(0.05)
        from prometheus_client import REGISTRY

        metrics = {
            "local": REGISTRY.get_sample_value("ngram_corpus_vllm_steps_total", {"outcome": "local"}),
            "corpus": REGISTRY.get_sample_value("ngram_corpus_vllm_steps_total", {"outcome": "corpus"}),
            "outages": REGISTRY.get_sample_value("ngram_corpus_vllm_outages_total", {})}
        return {"line": line, "metrics": metrics, "up_stats_steps": len(up["drafts"]), "down_drafts": down["drafts"],
                "down_vanilla": [o[0] for o in down["others"]], "down_stats": down_stats, "back_after_s": back_after,
                "stats": proposer.bridge.stats.as_dict(), "logs": logs.lines}
    finally:
        srv.kill()


def scenario_tp(workdir: Path) -> dict:
    """Two TP ranks (processes, gloo through vLLM's own distributed set-up) of one replica."""
    with CorpusServer(workdir / "corpus", "--namespace", "default") as srv:
        shared = tokens(60)
        teach(srv.target, "replica2-req", tokens(20), shared)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.scenarios", "tp-rank", str(workdir),
                                   str(rank), str(port), srv.target, json.dumps(shared)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        results = []
        for rank, out in enumerate(outs):
            got = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if not got:
                raise RuntimeError(f"TP rank {rank} printed no result:\n{out[-4000:]}")
            results.append(json.loads(got[0][len("RESULT "):]))
        return {"ranks": results, "shared": shared}


def tp_rank(workdir: Path, rank: int, port: int, target: str, shared: list[int]) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    line, cls, base, logs = load(target)
    from vllm.distributed import parallel_state

    parallel_state.init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                                local_rank=rank, backend="gloo")
    # What initialize_model_parallel builds for TP = 2 (it needs a whole VllmConfig, i.e. a model):
    # the TP group coordinator over ranks 0 and 1, on gloo, without a device communicator.
    parallel_state._TP = parallel_state.init_model_parallel_group([[0, 1]], rank, "gloo", group_name="tp",
                                                                  use_device_communicator=False)
    proposer = cls(proposer_config(K))
    rb = RunnerBatch(k=K)
    rb.add("req-tp", [5, 6, 7, 8])
    run = decode(proposer, rb, "req-tp", shared[:40])
    return {"rank": rank, "line": line, "has_client": proposer.bridge is not None, "drafts": run["drafts"],
            "steps": run["steps"], "stats": proposer.bridge.stats.as_dict() if proposer.bridge else None}


def scenario_loader(workdir: Path) -> dict:
    """Without NGRAM_CORPUS_TARGET, then (fresh loads) with an unusable value and on a proposer whose
    ``propose`` has other parameters: vLLM's class stays."""
    import vllm.plugins
    from vllm.v1.spec_decode import suffix_decoding

    import corpus_service.integrations.vllm as plugin

    original = suffix_decoding.SuffixDecodingProposer
    os.environ.pop("NGRAM_CORPUS_TARGET", None)
    vllm.plugins.load_general_plugins()
    unset = {"line": plugin.last_outcome, "unchanged": suffix_decoding.SuffixDecodingProposer is original}
    vllm.plugins.plugins_loaded, plugin.last_outcome = False, ""  # a new process, as far as loading goes
    os.environ.update(NGRAM_CORPUS_TARGET="127.0.0.1:1", NGRAM_CORPUS_TIMEOUT="soon")
    vllm.plugins.load_general_plugins()
    bad = {"line": plugin.last_outcome, "unchanged": suffix_decoding.SuffixDecodingProposer is original}

    class Changed(original):  # a vLLM whose propose lost a parameter
        def propose(self, num_speculative_tokens, input_batch, sampled_token_ids):
            return []

    suffix_decoding.SuffixDecodingProposer = Changed
    vllm.plugins.plugins_loaded, plugin.last_outcome = False, ""
    os.environ.pop("NGRAM_CORPUS_TIMEOUT")
    vllm.plugins.load_general_plugins()
    changed = {"line": plugin.last_outcome, "unchanged": suffix_decoding.SuffixDecodingProposer is Changed}
    return {"unset": unset, "bad": bad, "changed": changed}


def scenario_runner(workdir: Path) -> dict:
    """Loaded before the V1 GPU model runner is imported (as vLLM's worker does): the runner's name."""
    line, cls, base, logs = load("127.0.0.1:1")
    from vllm.v1.worker import gpu_model_runner

    return {"line": line, "runner_class_is_plugin": gpu_model_runner.SuffixDecodingProposer is cls,
            "subclass": issubclass(cls, base) and cls is not base}


def main(argv: list[str]) -> None:
    name, workdir = argv[0], Path(argv[1])
    if name == "tp-rank":
        res = tp_rank(workdir, int(argv[2]), int(argv[3]), argv[4], json.loads(argv[5]))
    else:
        res = {"proposer": scenario_proposer, "outage": scenario_outage, "tp": scenario_tp, "loader": scenario_loader,
               "runner": scenario_runner}[name](workdir)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
