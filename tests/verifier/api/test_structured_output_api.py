"""Structured output through the OpenAI-compatible API (real uvicorn on 127.0.0.1, real SmolLM2):
response_format json_schema / json_object, the regex and ebnf extensions, and 400s for bad ones."""

import json
import re

import jsonschema
import pytest
from engine_fixtures import serve_api

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def api(smollm2):
    with serve_api(smollm2, budget=6, timeout=300) as client:
        yield client


def test_json_schema_response_format_validates_and_matches_plain_decoding(api):
    body = {"messages": [{"role": "user", "content": "Paris is in France. Give the city and its country as JSON."}],
            "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}}
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    plain = api.post("/v1/chat/completions", json={**body, "speculate": False})
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert plain.json()["usage"]["draft_tokens"] == 0


def test_regex_completion_and_streamed_json_object(api):
    r = api.post("/v1/completions", json={"prompt": "The year the first moon landing happened was", "max_tokens": 8,
                                          "temperature": 0, "regex": r" [0-9]{4}\."})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r" [0-9]{4}\.", r.json()["choices"][0]["text"])
    msgs = [{"role": "user", "content": "Give a JSON object with one key, color, set to a color."}]
    text, finish = "", None
    with api.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 24, "temperature": 0,
                                                          "stream": True, "response_format": {"type": "json_object"}}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                text += c["delta"].get("content", "")
                finish = c["finish_reason"] or finish
    if finish == "stop":  # a complete object (max_tokens may cut a long one: finish "length")
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


@pytest.mark.parametrize("extra,needle", [
    ({"regex": "a("}, "regex"),
    ({"ebnf": "root ::= nothing"}, "nothing"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}, "wat"),
])
def test_bad_structured_output_requests_answer_400(api, extra, needle):
    r = api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
