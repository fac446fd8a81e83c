"""The SGLang plugin loaded by SGLang's own loader and driven as SGLang's NGRAM worker drives its
corpus, against real corpus services on 127.0.0.1 (scenarios.py; each runs in a child process with
the pinned SGLang from scripts/install_sglang.sh on its path)."""

from __future__ import annotations

import socket

import pytest

from tests.corpus_service.service_fixtures import TOKEN, ServerProcess
from tests.integrations.sglang.engine import ENGINE_DIR, engine_env, require_engine, run_scenario

from corpus_service.integrations.sglang.compat import version_mismatch, worker_mismatch

REPLACED = "corpus_service.integrations.sglang.corpus.SharedNgramCorpus"
SGLANGS = "sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus"


@pytest.fixture(scope="module", autouse=True)
def engine():
    require_engine()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("corpus"), "--namespace", "default", "--namespace", "small:vocab=1000")
    srv.start()
    yield srv
    srv.stop()


def env_for(server, **extra):
    return engine_env(NGRAM_CORPUS_TARGET=server.target, NGRAM_CORPUS_TOKEN=TOKEN, **extra)


def test_inert_without_target():
    out = run_scenario("load", {}, engine_env())
    assert out["cls"] == SGLANGS
    assert out["outcome"] == "NGRAM_CORPUS_TARGET is not set: SGLang keeps its own n-gram corpus"


def test_loaded_by_sglang_replaces_its_corpus(server):
    out = run_scenario("load", {}, env_for(server))
    assert out["cls"] == REPLACED
    assert out["outcome"].startswith(f"NgramCorpus replaced by the shared corpus at {server.target}")
    assert out["original_mismatch"] == ""  # SGLang 0.5.23's own class is the one it was built for
    assert "sam_threads" in out["wider_mismatch"]
    assert "Applied 1 hook(s) to " + SGLANGS in out["stderr"]


def test_another_sglang_version_is_refused():
    assert version_mismatch("0.5.23") == ""
    assert version_mismatch("0.5.24") == "SGLang 0.5.24 is not a version this plugin was built for (0.5.23)"
    assert version_mismatch(None) == "SGLang is not installed"


def test_a_different_worker_is_refused():
    source = (ENGINE_DIR / "sglang" / "srt" / "speculative" / "ngram_worker.py").read_text()
    assert worker_mismatch(source) == ""
    changed = source.replace("external_sam_budget=get_spec()", "sam_budget=get_spec()")
    assert "sam_budget" in worker_mismatch(changed)
    renamed = source.replace("self.ngram_corpus.batch_get(", "self.ngram_corpus.match(")
    assert "batch_get" in worker_mismatch(renamed)


def test_prompt_hook_keys_requests_and_never_fails_the_step(server):
    out = run_scenario("prompt_hook", {"k": 8}, env_for(server))
    assert out["result"] == "drafted" and out["calls"] == 1, out
    assert out["keyed"] == ["with-prompt"], out  # None and a missing field are skipped, not errors
    # A batch the hook cannot read: one warning, the step still drafts, and later steps too.
    assert out["broken"] == "drafted" and out["again"] == "drafted" and len(out["warnings"]) == 1, out


@pytest.mark.parametrize("k", [16, 8])
def test_two_replicas_draft_each_others_tokens(server, k):
    out = run_scenario("replicas", {"k": k, "seed": k}, env_for(server, NGRAM_CORPUS_NAMESPACE="default"))
    assert out["cls"] == "SharedNgramCorpus"
    assert out["taught"] > 0 and out["learned"] > out["before"]
    # B drafted A's request almost whole: 59 tokens in few steps of up to k - 1 accepted drafts.
    assert out["learned"] >= 59 - out["steps_b"] - 2 and out["steps_b"] <= 59 // (k - 1) + 3
    assert out["stats_b"]["steps_remote"] > 0 and out["stats_b"]["steps_local"] == 0
    # The prompt the worker hook passes keys both requests: A's output joined the key's history on the
    # service, and B drafted from it.
    before, after_a, after_b = out["history"]
    assert after_a["history_keys"] == before["history_keys"] + 1
    assert after_a["history_rollouts_added"] == before["history_rollouts_added"] + 1
    assert after_b["source_history_age0_tested_nodes"] > after_a["source_history_age0_tested_nodes"]
    drafts, mask = out["empty_drafts"], out["empty_mask"]
    assert len(drafts) == k and drafts[0] == 9 and len(mask) == k * k
    # Nothing known: what SGLang's own corpus returns, value for value and dtype for dtype.
    assert [out["empty_dtypes"][0], drafts, out["empty_dtypes"][1], mask] == out["sglang_empty"]


def test_external_corpus_added_through_one_replica_drafts_on_another(server):
    out = run_scenario("external", {"k": 16}, env_for(server))
    assert out["loaded"] == 300 and out["listed_b"] == {"docs": 300}
    assert out["budget_b"] == 10_000_000 - 300  # SGLang's external_corpus_max_tokens, counted fleet-wide
    assert out["accepted"] >= 59 - out["steps"] - 2
    assert "exceeds the remaining token budget" in out["over_budget"]
    assert out["listed_a_after"] == {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_ranks_propose_identical_drafts(server):
    import concurrent.futures

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_scenario, "tp", {"rank": r, "k": 8, "port": port, "delay": 2.0}, env_for(server))
                for r in (0, 1)]
        r0, r1 = (f.result() for f in runs)
    assert r0["drafts"] == r1["drafts"] and r0["mask"] == r1["mask"]
    assert r0["drafts"][1:1 + 7] == r0["first"][:7]  # what the corpus held when rank 0 asked
    # Between the ranks' calls another replica changed what the corpus drafts: asked directly, rank 1
    # would have proposed another tree.
    assert r1["direct"] != r1["drafts"] and r1["second"][0] in r1["direct"] and r1["second"][0] not in r1["drafts"]
    assert r0["stats"]["tp_size"] == 2 and r1["stats"]["tp_rank"] == 1
    assert r0["stats"]["steps_remote"] == 1 and r1["stats"]["steps_remote"] == 0


def test_corpus_outage_drafts_locally_and_comes_back(tmp_path):
    out = run_scenario("outage", {"k": 8, "dir": str(tmp_path)}, engine_env(NGRAM_CORPUS_RETRY_SECONDS="0.5"),
                       timeout=180)
    assert out["remote_before"] > 0
    assert out["down_accepted"] >= 79 - out["down_steps"] - 2  # the warm local fallback drafts the same tokens
    assert out["during"]["state"] == "unreachable" and out["during"]["steps_local"] >= out["down_steps"]
    # The replica started during the outage drafts locally from its first step, its namespace unchecked.
    late = out["late_during"]
    assert late["state"] == "unreachable" and late["steps_local"] == out["late_steps"] and late["steps_remote"] == 0
    assert late["namespace_check"] == "unchecked"
    # Said once per outage and replica: the running one, and the one that started during it.
    lines = out["unreachable_lines"]
    assert len(lines) == 2 and sum("not reachable at start" in ln for ln in lines) == 1, lines
    assert out["back_after_s"] is not None and out["back_after_s"] < 2.0  # NGRAM_CORPUS_RETRY_SECONDS=0.5
    assert out["after"]["state"] == "reachable" and out["after"]["outages"] >= 1
    assert out["late_back"]
    assert out["reachable_again_lines"]


def test_unknown_namespace_is_one_clear_error_at_start(server):
    out = run_scenario("bad_config", {"k": 8}, env_for(server, NGRAM_CORPUS_NAMESPACE="nosuch"))
    assert out["error"].startswith("NGRAM_CORPUS_NAMESPACE: the corpus at") and "'nosuch'" in out["error"]
    assert "default, small" in out["error"]


def test_vocabulary_mismatch_is_one_clear_error(server):
    out = run_scenario("bad_config", {"k": 8, "vocab": 49152}, env_for(server, NGRAM_CORPUS_NAMESPACE="small"))
    assert "1000 ids" in out["error"] and "49152" in out["error"]


def test_unusable_setting_fails_the_worker_not_sglang(server):
    out = run_scenario("bad_config", {"k": 8}, env_for(server, NGRAM_CORPUS_TIMEOUT="soon"))
    assert "NGRAM_CORPUS_TIMEOUT" in out["outcome"] and "will fail to start" in out["outcome"]
    assert out["error"].startswith("NGRAM_CORPUS_TIMEOUT: expected a number of seconds")


def test_wrong_token_is_one_clear_error_at_start(tmp_path):
    import json

    token = "tok-replica-3f9a0c7e51d24b68"
    clients = [{"name": "replica", "token": token, "namespaces": ["default"], "role": "draft"}]
    (tmp_path / "tokens.json").write_text(json.dumps({"clients": clients}))
    srv = ServerProcess(tmp_path, "--namespace", "default", "--client-tokens", str(tmp_path / "tokens.json")).start()
    try:
        wrong = run_scenario("bad_config", {"k": 8}, engine_env(NGRAM_CORPUS_TARGET=srv.target,
                                                                NGRAM_CORPUS_TOKEN=token[:-1] + "0"))
        right = run_scenario("bad_config", {"k": 8}, engine_env(NGRAM_CORPUS_TARGET=srv.target, NGRAM_CORPUS_TOKEN=token))
    finally:
        srv.stop()
    assert wrong["error"].startswith("NGRAM_CORPUS_TOKEN: the corpus at") and "UNAUTHENTICATED" in wrong["error"]
    assert token[:-1] not in wrong["error"]  # the token is never echoed
    assert right.get("built") == "SharedNgramCorpus" and "error" not in right
