"""Scenarios run in a child process with the real SGLang on its path (``engine.run_scenario``).

Each loads the plugin through SGLang's own ``load_plugins()``, takes ``NgramCorpus`` from SGLang's
module (the class SGLang's NGRAM worker would construct) and drives it as the worker does
(``worker_step``), against real corpus services on 127.0.0.1. The last stdout line is the result.

    python -m tests.integrations.sglang.scenarios NAME '{"k": 8, ...}'
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np

from bench.sglang_pattern import SGLANG_ARGS, flat_accept

WINDOW = SGLANG_ARGS["max_trie_depth"]  # the worker's query and put windows


class LineCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOG = LineCounter()


def load():
    """SGLang's loader runs the plugin; returns SGLang's NgramCorpus attribute (replaced or not)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger().addHandler(LOG)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.cpp_ngram import ngram_corpus

    load_plugins()
    return ngram_corpus.NgramCorpus


def build(cls, k: int):
    """As SGLang's worker builds its corpus (its keywords, the server's defaults)."""
    return cls(draft_token_num=k, match_type="BFS", **SGLANG_ARGS)


def worker_step(corpus, live: list[dict], k: int) -> list[int]:
    """One decode step as NGRAMWorker runs it: synchronize, batch_get on each request's last 18 tokens
    and full length, checks of what it returns, verify (the true tokens), batch_put of the windows.
    ``live``: {"rid", "ctx", "truth"}; returns the draft tokens accepted per request."""
    corpus.synchronize()
    drafts, mask = corpus.batch_get([r["rid"] for r in live], [r["ctx"][-WINDOW:] for r in live],
                                    [len(r["ctx"]) for r in live])
    n = len(live)
    assert isinstance(drafts, np.ndarray) and drafts.dtype == np.int64 and drafts.shape == (n * k,), (drafts.dtype, drafts.shape)
    assert isinstance(mask, np.ndarray) and mask.dtype == np.int64 and mask.shape == (n * k * k,), (mask.dtype, mask.shape)
    drafts, mask = drafts.reshape(n, k), mask.reshape(n, k, k)
    accepted = []
    for i, r in enumerate(live):
        assert drafts[i, 0] == r["ctx"][-1], "each row starts with the request's last token"
        assert np.all(np.diag(mask[i]) == 1) and np.all(mask[i][:, 0] == 1), "SGLang's ancestor mask"
        a = flat_accept(drafts[i], mask[i], r["truth"])
        commit = r["truth"][:a + 1]
        r["ctx"] = r["ctx"] + commit
        r["truth"] = r["truth"][len(commit):]
        accepted.append(a)
    corpus.batch_put([r["ctx"][-WINDOW:] for r in live])
    return accepted


def decode(corpus, rid: str, prompt: list[int], output: list[int], k: int) -> list[int]:
    """A whole request (the prefill made output[0]); its match state erased at the end, as the worker does."""
    r = {"rid": rid, "ctx": prompt + output[:1], "truth": output[1:]}
    accepted = []
    while r["truth"]:
        accepted += worker_step(corpus, [r], k)
    corpus.erase_match_state([rid])
    corpus.synchronize()
    return accepted


def sequence(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 30000, n)]


# ---------------------------------------------------------------------------------------------- scenarios

def s_load(args: dict) -> dict:
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus as original  # before the plugin runs

    cls = load()
    from corpus_service.integrations import sglang as plugin
    from corpus_service.integrations.sglang.compat import corpus_mismatch

    class Wider(original):  # an SGLang whose constructor takes one more argument
        def __init__(self, max_trie_depth=18, min_bfs_breadth=1, max_bfs_breadth=8, draft_token_num=8,
                     match_type="BFS", capacity=1000000, external_sam_budget=0,
                     external_corpus_max_tokens=10000000, sam_threads=1) -> None:
            pass

    return {"cls": f"{cls.__module__}.{cls.__qualname__}", "outcome": plugin.last_outcome,
            "original_mismatch": corpus_mismatch(original), "wider_mismatch": corpus_mismatch(Wider)}


def s_replicas(args: dict) -> dict:
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus as original  # before the plugin runs

    cls, k = load(), args["k"]
    sglang_d, sglang_m = build(original, k).batch_get(["x"], [[7, 8, 9]], [3])  # SGLang's own, with nothing known
    a, b = build(cls, k), build(cls, k)
    seed = 1000 * args.get("seed", 0)  # tests that share one server use their own sequences
    prompt, output = sequence(seed + 1, 40), sequence(seed + 2, 60)
    before = decode(b, "b-0", prompt, output, k)  # an empty corpus: B drafts nothing useful
    b.reset()
    fresh = build(cls, k)  # a third replica, for the empty case: an unseen context still gets K tokens
    fresh.synchronize()
    d, m = fresh.batch_get(["x"], [[7, 8, 9]], [3])
    from corpus_service.client import CorpusClient

    service = CorpusClient(os.environ["NGRAM_CORPUS_TARGET"], os.environ.get("NGRAM_CORPUS_NAMESPACE", "default"))
    history = ("history_keys", "history_rollouts_added", "source_history_age0_tested_nodes")
    stats0 = {key: service.stats()[key] for key in history}
    a.note_prompts([("a-1", prompt)])  # what the worker hook does: the request's prompt, its history key
    taught = decode(a, "a-1", prompt, output, k)  # replica A learns the request's tokens
    stats1 = {key: service.stats()[key] for key in history}
    b.note_prompts([("b-1", prompt)])
    learned = decode(b, "b-1", prompt, output, k)  # replica B drafts them (learned corpus and prompt history)
    stats2 = {key: service.stats()[key] for key in history}
    return {"before": sum(before), "taught": sum(taught), "learned": sum(learned), "steps_b": len(learned),
            "empty_drafts": d.tolist(), "empty_mask": m.tolist(), "cls": type(a).__name__,
            "sglang_empty": [sglang_d.dtype.name, sglang_d.tolist(), sglang_m.dtype.name, sglang_m.tolist()],
            "empty_dtypes": [d.dtype.name, m.dtype.name],
            "stats_a": a.stats(), "stats_b": b.stats(), "history": [stats0, stats1, stats2]}


def s_external(args: dict) -> dict:
    cls, k = load(), args["k"]
    a, b = build(cls, k), build(cls, k)
    doc = sequence(3, 300)
    loaded = a.load_external_corpus_named("docs", [doc[:150], doc[150:]])
    a.commit_external_corpus_load("docs", loaded)
    listed_b = b.list_external_corpora()
    budget_b = b.remaining_token_budget
    accepted = decode(b, "b-doc", sequence(4, 10) + doc[:20], doc[20:80], k)
    try:
        b.load_external_corpus_named("too-big", [sequence(5, 50)] * (budget_b // 50 + 1))
        over = "accepted"
    except ValueError as e:
        over = str(e)
    b.remove_external_corpus("docs")
    return {"loaded": loaded, "listed_b": listed_b, "budget_b": budget_b, "accepted": sum(accepted),
            "steps": len(accepted), "over_budget": over, "listed_a_after": a.list_external_corpora()}


def s_tp(args: dict) -> dict:
    """One TP rank of a 2-rank replica: gloo on the CPU, SGLang's own GroupCoordinator as its TP group."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    from corpus_service.client.sglang import RemoteNgramCorpus

    rank, k = args["rank"], args["k"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=2)
    group = GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                             use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                             use_xpu_communicator=False, group_name="tp")
    get_parallel().override_permanently(tp_group=group)  # as SGLang records its TP group at start-up
    cls = load()
    corpus = build(cls, k)
    ctx, first, second = sequence(6, 30), sequence(7, 20), sequence(8, 20)
    writer = RemoteNgramCorpus(os.environ["NGRAM_CORPUS_TARGET"], os.environ.get("NGRAM_CORPUS_NAMESPACE", "default"),
                               draft_token_num=k)
    if rank == 0:
        writer.batch_put([ctx[-WINDOW:] + first])
        writer.synchronize()
    dist.barrier()
    direct = None
    if rank == 1:
        time.sleep(args.get("delay", 1.0))  # rank 0 has asked by now; another replica writes meanwhile
        for _ in range(6):
            writer.batch_put([ctx[-WINDOW:] + second])
        writer.synchronize()
        d, _ = writer.batch_get(["direct"], [ctx[-WINDOW:]], [len(ctx)])
        direct = d.tolist()
    corpus.synchronize()
    drafts, mask = corpus.batch_get(["req-0"], [ctx[-WINDOW:]], [len(ctx)])
    corpus.batch_put([ctx[-WINDOW:] + first[:3]])
    corpus.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "drafts": drafts.tolist(), "mask": mask.tolist(), "direct": direct,
            "first": first, "second": second, "stats": corpus.stats()}


def s_outage(args: dict) -> dict:
    """The corpus stopped mid-run and started again on its port; a replica started while it is down."""
    from pathlib import Path

    from tests.corpus_service.service_fixtures import ServerProcess

    k = args["k"]
    srv = ServerProcess(Path(args["dir"]), "--namespace", "default", admin_token=None).start()
    os.environ["NGRAM_CORPUS_TARGET"] = srv.target
    cls = load()
    corpus = build(cls, k)
    prompt, output = sequence(10, 30), sequence(11, 80)
    decode(corpus, "warm", prompt, output, k)  # taught through the service, and the warm local fallback
    remote_before = corpus.stats()["steps_remote"]
    srv.stop()
    down = decode(corpus, "down", prompt, output, k)  # drafted locally, the same tokens
    late = build(cls, k)  # a replica that starts while the corpus is away
    late_accepted = decode(late, "late", prompt, output, k)
    during, late_during = corpus.stats(), late.stats()
    srv.start(grpc_port=srv.grpc_port)
    t_up, back_after = time.monotonic(), None
    r = {"rid": "back", "ctx": prompt + output[:1], "truth": output[1:] * 50}
    while time.monotonic() - t_up < 30:
        worker_step(corpus, [r], k)
        if corpus.stats()["steps_remote"] > during["steps_remote"]:
            back_after = time.monotonic() - t_up
            break
        time.sleep(0.02)
    late_back = False
    for _ in range(100):
        worker_step(late, [{"rid": "late2", "ctx": prompt + output[:1], "truth": output[1:]}], k)
        if late.stats()["steps_remote"] > 0:
            late_back = True
            break
        time.sleep(0.05)
    srv.stop()
    unreachable_lines = [ln for ln in LOG.lines if "is unreachable" in ln]
    return {"remote_before": remote_before, "down_accepted": sum(down), "down_steps": len(down),
            "during": during, "late_steps": len(late_accepted), "late_during": late_during, "back_after_s": back_after,
            "after": corpus.stats(), "late_back": late_back, "unreachable_lines": unreachable_lines,
            "reachable_again_lines": [ln for ln in LOG.lines if "reachable again" in ln]}


def s_bad_config(args: dict) -> dict:
    cls, k = load(), args["k"]
    from corpus_service.integrations import sglang as plugin

    out = {"outcome": plugin.last_outcome}
    try:
        corpus = build(cls, k)
        out["built"] = type(corpus).__name__
        if "vocab" in args:
            out["model_check"] = corpus.check_model(args["vocab"])
    except ValueError as e:
        out["error"] = str(e)
    return out


def s_prompt_hook(args: dict) -> dict:
    """The worker hook around ``_prepare_draft_tokens`` with what it reads of SGLang's batch: each
    ``Req``'s ``rid`` and ``origin_input_ids_unpadded`` (an ``array('q')``; SGLang's ``Req`` needs
    transformers to import, so plain objects carry those two fields). A prompt it cannot read (None, a
    missing field, a broken batch) never fails the decode step: the original still runs."""
    from array import array
    from types import SimpleNamespace

    cls = load()
    from corpus_service.integrations.sglang import worker_hooks

    corpus = build(cls, args["k"])
    worker = SimpleNamespace(ngram_corpus=corpus)
    reqs = [SimpleNamespace(rid="with-prompt", origin_input_ids_unpadded=array("q", [5, 6, 7, 8])),
            SimpleNamespace(rid="not-tokenized", origin_input_ids_unpadded=None), SimpleNamespace(rid="no-field")]
    calls = []
    result = worker_hooks.around_prepare_draft_tokens(lambda w, b: calls.append(b) or "drafted", worker,
                                                      SimpleNamespace(reqs=reqs))
    keyed = sorted(corpus._prompt_keys)
    broken = worker_hooks.around_prepare_draft_tokens(lambda w, b: "drafted", worker, SimpleNamespace(reqs=None))
    again = worker_hooks.around_prepare_draft_tokens(lambda w, b: "drafted", worker, SimpleNamespace(reqs=reqs))
    return {"result": result, "calls": len(calls), "keyed": keyed, "broken": broken, "again": again,
            "warnings": [ln for ln in LOG.lines if "cannot be read" in ln]}


SCENARIOS = {"prompt_hook": s_prompt_hook, "load": s_load, "replicas": s_replicas, "external": s_external, "tp": s_tp, "outage": s_outage,
             "bad_config": s_bad_config}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result, default=str))
