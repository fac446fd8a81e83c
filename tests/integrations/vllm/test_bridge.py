"""The plugin's parts that need no vLLM (these run in CI): the chain it takes from a draft tree,
its input checks, what it says on a machine without vLLM, and the per-step deadline."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service.engine.corpus import DraftBatch
from corpus_service.integrations.vllm import compat
from corpus_service.integrations.vllm.bridge import StepRequest, best_chain


def batch(rows: list[tuple[list[int], list[int], list[float]]], budget: int = 8) -> DraftBatch:
    n = len(rows)
    tokens, parents = np.full((n, budget), -1, np.int32), np.full((n, budget), -1, np.int32)
    probs, counts = np.zeros((n, budget), np.float32), np.zeros(n, np.int32)
    for i, (t, p, q) in enumerate(rows):
        tokens[i, :len(t)], parents[i, :len(t)], probs[i, :len(t)], counts[i] = t, p, q, len(t)
    return DraftBatch(tokens, parents, probs, counts)


def test_best_chain_follows_the_most_probable_child():
    # root -> 10 (0.6) -> 11 (0.5) -> 12 (0.2); root -> 20 (0.3) -> 21 (0.29); 10 -> 13 (0.05)
    b = batch([([10, 20, 11, 21, 13, 12], [-1, -1, 0, 1, 0, 2], [0.6, 0.3, 0.5, 0.29, 0.05, 0.2])])
    assert best_chain(b, 0, 8) == [10, 11, 12]
    assert best_chain(b, 0, 2) == [10, 11]
    assert best_chain(b, 0, 0) == []


def test_best_chain_of_an_empty_tree_and_a_single_node():
    b = batch([([], [], []), ([7], [-1], [0.9])])
    assert best_chain(b, 0, 8) == []
    assert best_chain(b, 1, 8) == [7]


def test_step_request_checks_its_lengths():
    ids = np.arange(10)
    StepRequest("r", ids, 4, 10, 8)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        StepRequest("r", ids, 0, 5, 8)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        StepRequest("r", ids, 4, 11, 8)
    with pytest.raises(ValueError, match="max_draft"):
        StepRequest("r", ids, 4, 10, -1)


def test_without_vllm_the_plugin_says_why_and_patches_nothing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # this test process never has vLLM
    why, base = compat.check_engine()
    assert base is None and "not importable" in why


def test_a_stalled_corpus_costs_a_step_its_deadline_then_drafts_resume(tmp_path, caplog):
    """Through a real TCP proxy to a real server: a step never waits past NGRAM_CORPUS_TIMEOUT."""
    import logging
    import time

    from bench.common import CorpusServer
    from corpus_service.integrations.settings import IntegrationSettings
    from corpus_service.integrations.vllm.bridge import CorpusBridge
    from tests.tcp_proxy import ProxyProcess

    ctx = np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], dtype=np.int32)
    with CorpusServer(tmp_path / "corpus", "--namespace", "default") as srv:
        proxy = ProxyProcess(srv.target).start()
        try:
            bridge = CorpusBridge(IntegrationSettings(proxy.address, timeout=0.5, retry_seconds=0.5))
            assert bridge.check() == ""
            assert bridge.step([StepRequest("r", ctx, 4, 10, 4)], {"r"}) == [[7, 8, 5, 6]]
            proxy.set_mode("stall")
            caplog.set_level(logging.WARNING, "corpus_service.integrations.vllm")
            t0 = time.monotonic()
            assert bridge.step([StepRequest("r", ctx, 4, 11, 4)], {"r"}) is None
            assert time.monotonic() - t0 < 2.0  # the deadline (0.5 s) plus the host's scheduling
            assert bridge.stats.deadline_misses == 1 and bridge.stats.outages == 1
            proxy.set_mode("pass")
            deadline, answered = time.monotonic() + 10, None
            while answered is None and time.monotonic() < deadline:
                answered = bridge.step([StepRequest("r", ctx, 4, 11, 4)], {"r"})
                time.sleep(0.05)
            assert answered == [[8, 5, 6, 7]]  # the live request was replayed to a new session
            assert [r.getMessage().count("no drafts from the corpus") for r in caplog.records].count(1) == 1
            bridge.close()
        finally:
            proxy.stop()
