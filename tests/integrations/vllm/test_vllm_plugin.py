"""The vLLM plugin with vLLM 0.33.0's own code: its loader, its suffix proposer (the plugin's
subclass, built as the runner builds it) driven through its real InputBatch, against a real corpus
server on 127.0.0.1; tensor parallelism over two gloo processes; an outage of the corpus."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.engine import run_scenario
from tests.integrations.vllm.scenarios import K

pytestmark = pytest.mark.slow


def test_loader_leaves_vllm_alone_without_target_with_a_bad_value_or_another_signature(tmp_path):
    res = run_scenario("loader", tmp_path)
    assert res["unset"]["unchanged"] and "NGRAM_CORPUS_TARGET is not set" in res["unset"]["line"]
    assert res["bad"]["unchanged"] and "NGRAM_CORPUS_TIMEOUT" in res["bad"]["line"]
    assert "keeps its own suffix speculation" in res["bad"]["line"]
    changed = res["changed"]
    assert changed["unchanged"] and "propose('self', 'num_speculative_tokens', 'input_batch', 'sampled_token_ids')" in changed["line"]


def test_the_runner_builds_the_plugins_proposer(tmp_path):
    res = run_scenario("runner", tmp_path)
    assert "drafts from the corpus at 127.0.0.1:1" in res["line"]
    assert res["runner_class_is_plugin"] and res["subclass"]


def test_vllms_suffix_proposer_drafts_from_and_feeds_the_shared_corpus(tmp_path):
    res = run_scenario("proposer", tmp_path)
    assert res["subclass"]
    shared, own = res["shared"], res["own"]
    # Another replica taught the corpus `shared`; this replica's first draft continues it, which
    # vLLM's own cache (never shown it) cannot.
    first = res["first_draft"]
    assert 0 < len(first) <= K and first == shared[1:1 + len(first)]
    assert res["vanilla_first"] == []
    assert res["steps"] < res["tokens"] - 10  # the taught 20 tokens took a few steps, not 20
    # What this replica decoded reached the corpus: another replica's request drafts its continuation.
    assert res["learned_chain"] == own[6:6 + K]
    stats = res["stats"]
    assert stats["corpus_steps"] == stats["steps"] > 0 and stats["fallback_steps"] == 0 and stats["outages"] == 0
    assert sum(1 for ln in res["logs"] if "drafts from 127.0.0.1" in ln) == 1


def test_every_tp_rank_proposes_the_leaders_drafts(tmp_path):
    res = run_scenario("tp", tmp_path)
    leader, follower = res["ranks"]
    assert leader["has_client"] and not follower["has_client"]  # only rank 0 talks to the corpus
    assert leader["drafts"] == follower["drafts"] and any(leader["drafts"])
    assert leader["stats"]["corpus_steps"] == leader["steps"]
    shared = res["shared"]
    first = leader["drafts"][0]
    assert first == shared[1:1 + len(first)]


def test_an_outage_falls_back_to_vllms_own_drafts_said_once_and_recovers(tmp_path):
    res = run_scenario("outage", tmp_path)
    # While the corpus is down every step proposes exactly what vLLM's own proposer proposes.
    assert res["down_drafts"] == res["down_vanilla"] and all(res["down_drafts"])
    down = res["down_stats"]
    assert down["in_outage"] and down["outages"] == 1 and down["fallback_steps"] == len(res["down_drafts"])
    warned = [ln for ln in res["logs"] if "no drafts from the corpus" in ln]
    assert len(warned) == 1
    # Back within seconds of the corpus returning (NGRAM_CORPUS_RETRY_SECONDS=0.5 here), said once.
    assert res["back_after_s"] is not None and res["back_after_s"] < 5
    assert sum(1 for ln in res["logs"] if "answers again" in ln) == 1
    assert not res["stats"]["in_outage"] and res["stats"]["outages"] == 1
    # The same counts in the worker's Prometheus metrics.
    assert res["metrics"] == {"local": res["stats"]["fallback_steps"], "corpus": res["stats"]["corpus_steps"], "outages": 1}
