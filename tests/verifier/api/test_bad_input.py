"""Bad input the API once answered with a 500, now a 400 naming the problem (real uvicorn server,
real SmolLM2): lone surrogates and control characters, integers past the engine's types, structured-
output specs llguidance would accept and fail on later, a prompt that fills the context, stop token
ids outside the vocabulary."""

import json

import pytest
from engine_fixtures import serve_api

from corpus_service import check_prompt_key
from verifier.step.spec_limits import MAX_REPEAT, MAX_SCHEMA_DEPTH, check_regex, check_schema

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def api(smollm2):
    with serve_api(smollm2, budget=4) as client:
        yield client


def post_raw(api, path: str, text: str):
    """``text`` sent as is: json.dumps would escape a lone surrogate the same way, but an explicit
    body shows what goes over the wire."""
    return api.post(path, content=text.encode("ascii"), headers={"content-type": "application/json"})


def refused(r, param: str | None, *words: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param is None or err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    assert "0x" not in r.text and "Traceback" not in r.text and "(self:" not in r.text
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "hi", "prompt_key": "k\\ud800", "max_tokens": 2}', "prompt_key"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop.0"),
])
def test_lone_surrogates_are_400(api, path, body, param):
    err = refused(post_raw(api, path, body), param, "lone surrogate")
    assert err["code"] == "invalid_unicode"


@pytest.mark.parametrize("key", ["a\x85b", "a\u2028b", "a\u2029", "\x7f", "tab\there", "\x9f"])
def test_prompt_keys_with_control_characters_or_separators_are_400(api, key):
    bad = next(ch for ch in key if not ch.isalpha())
    refused(api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "prompt_key": key}), "prompt_key",
            f"U+{ord(bad):04X}")
    with pytest.raises(ValueError, match="U\\+"):
        check_prompt_key(key)
    assert check_prompt_key("gsm8k:train:17 é🙂") == "gsm8k:train:17 é🙂"  # other Unicode stays allowed


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**64 + 5), ("max_tokens", 2**63), ("n", 2**70), ("seed", 2**63), ("seed", -1),
    ("min_tokens", 2**40), ("logprobs", 2**63), ("best_of", 2**63), ("policy_version", 2**62),
    ("stop_token_ids", [2**63]), ("top_k", True), ("max_tokens", 5.0), ("n", "2"), ("stream", 1),
])
def test_integers_out_of_range_or_not_ints_are_400(api, field, value):
    refused(api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}), None, field)


def test_a_huge_integer_literal_and_deep_nesting_are_400(api):
    refused(post_raw(api, "/v1/completions", '{"prompt": "hi", "top_k": ' + "9" * 5000 + "}"), None, "JSON")
    deep = '{"prompt": "hi", "response_format": ' + "[" * 100_000 + "]" * 100_000 + "}"
    refused(post_raw(api, "/v1/completions", deep), None, "nested")


def test_stop_token_ids_outside_the_vocabulary_are_400(api):
    refused(api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2, 49152]}),
            "stop_token_ids", "49152", "vocabulary")
    assert api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                             "stop_token_ids": [49151]}).status_code == 200


def test_a_prompt_that_fills_the_context_says_so(api):
    full = list(range(100, 100 + 639))  # the fixture's max_len is 640: no room for a token of output
    err = refused(api.post("/v1/completions", json={"prompt": full}), "prompt", "639 prompt tokens", "no room")
    assert "max_tokens" not in err["message"]
    r = api.post("/v1/completions", json={"prompt": full[:-1], "temperature": 0})  # room for exactly one
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("extra,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}},
     ["recursive $ref"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}}, ["recursive $ref"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"}}}},
     ["recursive $ref", "#/$defs/a"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/x"}}}},
     ["does not resolve"]),
    ({"regex": "a{1000000}"}, ["repetition count 1000000", str(MAX_REPEAT)]),
    ({"regex": "(ab{400}){400}"}, ["multiply"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "string", "pattern": "x{50000}"}}}}, ["pattern", "50000"]),
    ({"ebnf": "root ::= root"}, ["no finite output"]),
    ({"ebnf": 'root ::= "a"{1000000}'}, ["ebnf: repetition count 1000000"]),
    ({"ebnf": "start: /(a{1000}){1000}/"}, ["ebnf: nested repetition counts multiply"]),
    ({"ebnf": 'start: "a" ~ 2000000'}, ["ebnf: repetition count 2000000"]),
    ({"regex": "("}, ["regex"]),
])
def test_structured_output_specs_that_cannot_work_are_400_at_request_time(api, extra, words):
    err = refused(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **extra}), None, *words)
    assert "<non-verbose/>" not in err["message"] and "Earley" not in err["message"]


def test_a_deep_schema_is_400_and_a_schema_with_shared_definitions_works(api):
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": deep}}
    refused(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "response_format": rf}), None,
            "nested more than")
    shared = {"$defs": {"w": {"type": "string", "maxLength": 8}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/w"}, "b": {"$ref": "#/$defs/w"}}, "required": ["a", "b"],
              "additionalProperties": False}
    r = api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 40, "temperature": 0,
                                               "response_format": {"type": "json_schema",
                                                                   "json_schema": {"name": "r", "schema": shared}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) == {"a", "b"}


def test_spec_limits_directly():
    check_regex(r"\d{4}-[{]{2}(ab){3}")  # escapes and classes are no counts
    check_schema({"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "integer"}}})
    with pytest.raises(ValueError, match="recursive"):
        check_schema({"properties": {"a": {"items": {"$ref": "#/properties/a"}}}})
    with pytest.raises(ValueError, match="only local"):
        check_schema({"$ref": "https://example.com/s.json"})


def test_errors_name_a_bad_value_without_echoing_it(api):
    """17 stop strings of 100 KB each were once echoed whole in the 400 (1.7 MB): an error names
    the problem, and any message is cut to MAX_ERROR_CHARS."""
    from verifier.api.app import MAX_ERROR_CHARS, _error

    r = api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": ["b" * 100_000] * 17})
    refused(r, None, "stop", "got 17")
    assert len(r.content) < 1_000, len(r.content)
    r = api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": ["x" * 100_000, ""]})
    refused(r, None, "stop", "str '' at index 1")
    # Any message (and param) is cut, whatever built it.
    body = json.loads(_error(400, "x: " + "y" * 50_000, "p" * 5_000).body)["error"]
    assert len(body["message"]) <= MAX_ERROR_CHARS + 40 and "50,003 characters" in body["message"], body
    assert len(body["param"]) <= MAX_ERROR_CHARS + 40, body
