"""The n samples of one API request start as one corpus request group (real uvicorn server, real
SmolLM2, the in-process corpus): greedy samples stay identical to non-speculative decoding, the
group reaches the drafter, and it is freed when the request ends."""

import pytest
from engine_fixtures import serve_api

from verifier.draft.drafter import DraftConfig, Drafter

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"


class RecordingDrafter(Drafter):
    """The real in-process drafter, noting the group key of every request it starts."""

    def __init__(self, **kwargs) -> None:
        super().__init__("local", **kwargs)
        self.started: list[tuple[str, str | None]] = []
        self.groups_seen = 0  # most live groups in the corpus at a draft

    def start_request(self, req_id: str, prompt_ids: list[int], group: str | None = None) -> None:
        self.started.append((req_id, group))
        super().start_request(req_id, prompt_ids, group=group)

    def draft(self, req_ids: list[str], budget: int):
        self.groups_seen = max(self.groups_seen, int(self.local.stats()["live_groups"]))
        return super().draft(req_ids, budget)


@pytest.fixture(scope="module")
def served(smollm2):
    drafter = RecordingDrafter(vocab_size=smollm2.model.config.vocab_size)
    with serve_api(smollm2, budget=4, drafter=drafter) as client:
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
