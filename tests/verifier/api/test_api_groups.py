"""The n samples of one API request start as one corpus request group (real uvicorn server, real
SmolLM2, the in-process corpus): greedy samples stay identical to non-speculative decoding, the
group reaches the drafter, and it is freed when the request ends. The RL extensions: prompt_key and
policy_version reach the corpus with every sample (their outputs join the key's history), bad ones
answer 400, and POST /v1/policy-version moves the corpus' version forward."""

import pytest
from engine_fixtures import ADMIN, serve_api

from verifier.draft.drafter import DraftConfig, Drafter

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"


class RecordingDrafter(Drafter):
    """The real in-process drafter, noting the group key of every request it starts."""

    def __init__(self, **kwargs) -> None:
        super().__init__("local", **kwargs)
        self.started: list[tuple[str, str | None]] = []
        self.history: list[tuple[str | None, int | None]] = []  # (prompt_key, policy_version) of each start
        self.groups_seen = 0  # most live groups in the corpus at a draft

    def start_request(self, req_id: str, prompt_ids: list[int], group: str | None = None, *,
                      prompt_key: str | None = None, policy_version: int | None = None) -> None:
        self.started.append((req_id, group))
        self.history.append((prompt_key, policy_version))
        super().start_request(req_id, prompt_ids, group=group, prompt_key=prompt_key, policy_version=policy_version)

    def draft(self, req_ids: list[str], budget: int):
        self.groups_seen = max(self.groups_seen, int(self.local.stats()["live_groups"]))
        return super().draft(req_ids, budget)


@pytest.fixture(scope="module")
def served(smollm2):
    drafter = RecordingDrafter(vocab_size=smollm2.model.config.vocab_size)
    with serve_api(smollm2, budget=4, drafter=drafter, policy_version=True) as client:
        yield client, drafter


def test_n_greedy_samples_draft_as_one_group_and_match_plain_decoding(served):
    api, drafter = served
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = api.post("/v1/completions", json={**body, "speculate": False})
    assert plain.status_code == 200, plain.text
    drafter.started.clear()
    drafter.groups_seen = 0
    r = api.post("/v1/completions", json={**body, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    texts = [c["text"] for c in out["choices"]]
    assert texts == [plain.json()["choices"][0]["text"]] * 2
    assert out["usage"]["verify_steps"] >= 1
    groups = [g for _, g in drafter.started]
    assert len(groups) == 2 and groups[0] == groups[1] == out["id"]
    assert drafter.groups_seen == 1  # the samples drafted inside their group
    stats = drafter.local.stats()
    assert stats["live_groups"] == 0 and stats["live_requests"] == 0  # freed with the request


def test_a_single_sample_starts_no_group(served):
    api, drafter = served
    drafter.started.clear()
    r = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [g for _, g in drafter.started] == [None]


def test_remote_drafter_passes_the_group_to_the_corpus_service(corpus_server):
    # Through the real gRPC client: the remote corpus drafts b from its sibling a's tokens, and the
    # in-process fallback mirrors the group too.
    draft = DraftConfig(draft_timeout_s=5.0, corpus_timeout_s=5.0, remote_drafts="sync")
    drafter = Drafter(corpus_server.target, draft)
    try:
        prompt = [5, 17, 9, 33, 2, 41, 8]
        for rid in ("a", "b"):
            drafter.start_request(rid, prompt, group="req-1")
        drafter.extend("a", [100, 101, 102, 103])
        drafter.extend("b", [100])
        tokens = drafter.draft(["b"], 4).tree(0)[0]
        assert drafter.stats.remote_steps == 1 and tokens == [101, 102, 103]
        assert drafter.local.draft(["b"], 4).tree(0)[0] == [101, 102, 103]
        for rid in ("a", "b"):
            drafter.finish(rid)
    finally:
        drafter.close()


def test_prompt_key_and_policy_version_reach_the_corpus_history(served):
    api, drafter = served
    drafter.started.clear()
    drafter.history.clear()
    drafter.groups_seen = 0
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 3, "prompt_key": "gsm8k:train:17",
            "policy_version": 4}
    r = api.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # An explicit key groups the key's live requests corpus-wide (siblings on any replica): no group of its own.
    assert [g for _, g in drafter.started] == [None] * 3
    assert drafter.history == [("gsm8k:train:17", 4)] * 3
    assert drafter.groups_seen == 1  # the key's implied group: the siblings drafted from each other
    assert len(r.json()["choices"]) == 3
    history = drafter.local.prompt_history("gsm8k:train:17")
    assert [v for v, _ in history] == [4, 4, 4] and all(n >= 1 for _, n in history)
    # The chat route carries them too.
    chat = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                  "temperature": 0, "prompt_key": "chat-1", "policy_version": 0})
    assert chat.status_code == 200, chat.text
    assert drafter.history[-1] == ("chat-1", 0) and len(drafter.local.prompt_history("chat-1")) == 1


@pytest.mark.parametrize("field, value, words", [
    ("prompt_key", "", "1-256 characters"),
    ("prompt_key", "k" * 257, "1-256 characters"),
    ("prompt_key", "a\tb", "control"),
    ("prompt_key", 17, "string"),
    ("policy_version", -1, "greater than or equal to 0"),
    ("policy_version", 2**62, "less than or equal"),
    ("policy_version", "new", "integer"),
])
def test_bad_prompt_keys_and_versions_answer_400(served, field, value, words):
    api, _ = served
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = api.post(path, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and (words in err["message"] or field == "prompt_key" and value == "a\tb"), err


def test_policy_version_route_moves_forward_only(served):
    api, drafter = served
    current = drafter.local.policy_version()
    r = api.post("/v1/policy-version", json={"version": current + 2})
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"], r.text  # the route is the admin's
    assert drafter.local.policy_version() == current
    r = api.post("/v1/policy-version", json={"version": current + 2}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json() == {"version": current + 2, "corpus": "local"} and drafter.local.policy_version() == current + 2
    stale = api.post("/v1/policy-version", json={"version": current + 1}, headers=ADMIN)
    assert stale.status_code == 409 and "older" in stale.json()["error"]["message"], stale.text
    for bad in ({}, {"version": -1}, {"version": 1, "extra": 1}, {"version": True}, {"version": 2**70},
                {"version": current + 2 + (1 << 20) + 1}, {"version": (1 << 62) - 1}):  # (the last two: too far)
        assert api.post("/v1/policy-version", json=bad, headers=ADMIN).status_code == 400
    assert drafter.local.policy_version() == current + 2
    # A request without a version is sampled by the announced one.
    drafter.history.clear()
    r = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_key": "v-test"})
    assert r.status_code == 200 and drafter.history == [("v-test", None)]
    assert [v for v, _ in drafter.local.prompt_history("v-test")] == [current + 2]
    metrics = api.get("/metrics").text  # the engine's busy periods: the last one is a batch's makespan
    assert "ngram_verifier_last_makespan_seconds" in metrics and "ngram_verifier_busy_periods_total" in metrics
