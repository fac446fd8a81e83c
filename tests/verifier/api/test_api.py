"""The OpenAI-compatible API through a real uvicorn server on 127.0.0.1 (ephemeral port)."""

import json

import pytest
from engine_fixtures import serve_api


@pytest.fixture(scope="module")
def api(smollm2):
    with serve_api(smollm2, budget=4) as client:
        yield client


def test_completions_with_speculative_usage(api):
    r = api.post("/v1/completions", json={"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
                                          "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    u = body["usage"]
    assert u["completion_tokens"] == 12 and u["verify_steps"] >= 1
    # each step commits its accepted drafts + a bonus token (cut at max_tokens); prefill commits one
    assert u["completion_tokens"] - 1 <= u["accepted_draft_tokens"] + u["verify_steps"] <= u["completion_tokens"]


def test_chat_and_streaming_agree(api):
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    r = api.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    chunks = []
    with api.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0,
                                                          "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert streamed == text
    assert events[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "exceeds"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
])
def test_bad_requests_answer_400_with_a_message(api, path, body, needle):
    r = api.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_json_is_400(api):
    r = api.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_models_health_metrics(api):
    health = api.get("/healthz").json()
    assert health["status"] == "ok" and health["corpus"] == {"target": "local"}
    assert health["weights"] == {"updates_enabled": False, "updates": 0, "failed_updates": 0, "updating": False,
                                 "last": {}}
    # The engine's projections: 4 slots x 16 rows exceed norm_linear's 32, so torch's matmuls, unprobed.
    assert health["native_linear"] is False and health["linear_probe_ms"] is None
    assert api.get("/v1/models").json()["data"][0]["id"] == "smollm2"
    assert api.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    m = api.get("/metrics").text
    assert "ngram_verifier_generated_tokens_total" in m and "ngram_verifier_draft_steps_total" in m
    assert 'ngram_verifier_budget_plain_switches_total{reason="cost"}' in m
    assert "ngram_verifier_budget_cost_model_refits_total" in m
    assert 'ngram_verifier_budget_rank_calibration{ranks="1-1"}' in m  # per band of draft-node ranks
    assert 'ngram_verifier_budget_rank_calibration{ranks="8-15"}' in m
    # Per request (verifier/budget/request_gate.py): switches to no drafts by reason, request-steps held off.
    assert 'ngram_verifier_budget_request_no_draft_switches_total{reason="acceptance"}' in m
    assert "ngram_verifier_budget_request_steps_no_draft_total" in m
    assert "ngram_verifier_budget_plain_steps_backoff_total" in m


def test_cli_rejects_bad_flags_without_loading_a_model(capsys):
    from verifier.cli import main

    assert main(["serve", "--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # off loopback needs an API key
