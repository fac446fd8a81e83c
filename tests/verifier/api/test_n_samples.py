"""The serving fields through a real uvicorn server (127.0.0.1, ephemeral port) and the real
SmolLM2: n samples and best_of, logprobs in the completions and chat shapes (JSON and SSE),
penalties and stops; speculative and plain answers agree."""

import json

import pytest

from tests.verifier.api.test_api import api  # noqa: F401 (the server fixture)

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
TOL = 1e-3


def complete(api, **body):
    r = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(api, path, body) -> list[dict]:
    events = []
    with api.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_completion_logprobs_speculative_equal_plain(api):
    spec = complete(api, logprobs=3, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    plain = complete(api, logprobs=3, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                     speculate=False)
    a, b = spec["choices"][0], plain["choices"][0]
    assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    lp = a["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == a["text"] and lp["text_offset"][0] == 0
    assert all(len(t) <= 3 and max(t.values()) <= 0 for t in lp["top_logprobs"])
    assert all(abs(x - y) < TOL for x, y in zip(lp["token_logprobs"], b["logprobs"]["token_logprobs"]))


def test_chat_logprobs_shape(api):
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode("utf-8") == e["token"]
    streamed = [c for ev in sse(api, "/v1/chat/completions", body) for ch in ev["choices"]
                if ch.get("logprobs") for c in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert all(abs(x["logprob"] - y["logprob"]) < TOL for x, y in zip(streamed, content))


def test_n_samples_stream_and_json_agree(api):
    one = complete(api, logprobs=1)["choices"][0]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    events = sse(api, "/v1/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 16
    for i in range(2):
        chunks = [ch for ev in events for ch in ev["choices"] if ch["index"] == i]
        assert "".join(ch["text"] for ch in chunks) == one["text"]
        assert [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]] == one["logprobs"]["tokens"]
        assert chunks[-1]["finish_reason"] == "length"


def test_n_samples_use_consecutive_seeds_and_best_of_picks_the_likeliest(api):
    common = {"temperature": 1.0, "seed": 42, "speculate": False, "logprobs": 0}
    n3 = complete(api, n=3, **common)
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2] and n3["usage"]["completion_tokens"] == 24
    for i in range(3):  # sample i is the single request with seed 42 + i
        alone = complete(api, **{**common, "seed": 42 + i})["choices"][0]
        assert alone["text"] == n3["choices"][i]["text"]
    best = complete(api, n=1, best_of=3, **{**common, "logprobs": None})
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in n3["choices"]]
    assert best["choices"][0]["text"] == n3["choices"][scores.index(max(scores))]["text"]


def test_stop_token_and_min_tokens_through_the_api(api):
    free = complete(api, logprobs=0)["choices"][0]
    tokens = free["logprobs"]["tokens"]
    stop = complete(api, stop=tokens[2].strip() or tokens[2])
    assert stop["choices"][0]["finish_reason"] == "stop" and len(stop["choices"][0]["text"]) < len(free["text"])
    r = complete(api, stop=tokens[1].strip() or tokens[1], min_tokens=6, speculate=False)
    s = complete(api, stop=tokens[1].strip() or tokens[1], min_tokens=6)
    assert r["choices"][0]["text"] == s["choices"][0]["text"] and r["usage"]["completion_tokens"] >= 6


@pytest.mark.parametrize("body,needle", [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "stream"),
    ({"n": 17}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 100, "max_tokens": 8}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_fields_answer_400(api, body, needle):
    r = api.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_top_logprobs_needs_logprobs(api):
    r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
