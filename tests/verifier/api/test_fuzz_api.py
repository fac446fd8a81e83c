"""Hostile traffic against the OpenAI-compatible routes of a real uvicorn server (127.0.0.1) on the
tiny random model (hypothesis): request bodies drawn field by field from the schemas' fields with
good, out-of-range and wrongly typed values (ints past 2^63, true for ints, NaN, lone surrogates,
control characters, deep nesting, pathological structured-output specs), and raw bytes under any
Content-Type. No answer is a 5xx, and no body carries a traceback, an object address, a pybind11
signature or a list of token ids. Deterministic under CI=true (tests/conftest.py's profile)."""

from __future__ import annotations

import json
import os
import re

import pytest
from engine_fixtures import serve_api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_lm import tiny_lm

V = 64
ROUTES = ("/v1/completions", "/v1/chat/completions")
# What a body must never show: a traceback, an address (0x7f...), a pybind11 call signature
# ("Invoked with:", "(self: ..."), or a run of token ids (an error echoing a prompt's ids).
LEAKS = re.compile(r"Traceback|File \"|0x[0-9a-fA-F]{6,}|Invoked with|\(self: |pybind11|std::|\[(?:\d+, ){7,}\d+\]")
# Examples per test: 40 keeps the module near 20 s on 2 cores (each body is a real HTTP request, a
# valid one decodes); NGRAM_HYPOTHESIS_EXAMPLES raises it for a long run by hand.
EXAMPLES = int(os.environ.get("NGRAM_HYPOTHESIS_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
hostile_chars = st.sampled_from(["\x00", "\x85", "\u2028", "\u2029", "\x7f", "\ufeff", "\U0010ffff", "t3 "])
text = st.lists(st.one_of(st.sampled_from([f"t{i} " for i in range(V)]), st.characters(), surrogates, hostile_chars),
               max_size=12).map("".join)
huge = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
ints = st.one_of(st.integers(-3, 70), huge)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True), text)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(text, inner, max_size=3)), max_leaves=8)


def deep(n: int) -> object:
    out: object = []
    for _ in range(n):
        out = [out]
    return out


schemas = st.one_of(
    st.just({"$ref": "#"}), st.just({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    st.just({"type": "string", "pattern": "a{1000000}"}), st.just({"$ref": "#/nowhere"}),
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.builds(lambda n: {"type": "array", "items": deep(n)}, st.integers(60, 200)), junk)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"name": text, "schema": schemas})}), junk)
COMMON = {
    "model": st.one_of(st.none(), st.just("smollm2"), text), "max_tokens": st.one_of(st.integers(1, 6), ints),
    "temperature": st.one_of(st.floats(0, 2), scalars), "top_p": st.one_of(st.floats(0, 1), scalars),
    "top_k": ints, "n": st.one_of(st.integers(1, 3), ints), "stream": st.one_of(st.booleans(), scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "stop": st.one_of(text, st.lists(text, max_size=20), junk), "seed": ints, "ignore_eos": scalars,
    "speculate": scalars, "presence_penalty": scalars, "frequency_penalty": scalars,
    "repetition_penalty": scalars, "min_tokens": ints, "stop_token_ids": st.one_of(st.lists(ints, max_size=4), junk),
    "response_format": response_formats, "regex": st.one_of(st.sampled_from(["a{1000000}", "(a{500}){500}", "(", "t1"]),
                                                            text),
    "ebnf": st.one_of(st.sampled_from(["root ::= root", 'root ::= "t1"', "start: start"]), text),
    "prompt_key": st.one_of(text, junk), "policy_version": ints, "user": scalars, "logit_bias": junk,
    "tools": junk, "unknown_field": junk,
}
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus", ""]),
                                           "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                               {"type": st.just("text"), "text": text}), max_size=2), junk)}), junk)
COMPLETIONS = {**COMMON, "prompt": st.one_of(text, st.lists(st.one_of(st.integers(0, V + 2), huge), min_size=0,
                                                                       max_size=70), junk),
               "logprobs": ints, "best_of": ints, "echo": scalars, "suffix": scalars}
CHAT = {**COMMON, "messages": st.one_of(st.lists(message, min_size=0, max_size=3), junk), "logprobs": scalars,
        "top_logprobs": ints, "max_completion_tokens": ints}


def bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """The required field and any subset of the others."""
    return st.fixed_dictionaries({required: fields[required]},
                                 optional={k: v for k, v in fields.items() if k != required})


@pytest.fixture(scope="module")
def api():
    lm = tiny_lm(vocab_size=V, seed=4)
    with serve_api(lm, budget=2, max_len=24, timeout=60) as client:  # short answers: many examples
        yield client


def check(r) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    assert not LEAKS.search(r.text), r.text[:2000]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err


def send(api, route: str, body: dict):
    return api.post(route, content=json.dumps(body, ensure_ascii=True, allow_nan=True).encode(),
                    headers={"content-type": "application/json"})


@FUZZ
@given(body=bodies(COMPLETIONS, "prompt"))
def test_completions_bodies(api, body):
    check(send(api, "/v1/completions", body))


@FUZZ
@given(body=bodies(CHAT, "messages"))
def test_chat_bodies(api, body):
    check(send(api, "/v1/chat/completions", body))


@FUZZ
@given(route=st.sampled_from(ROUTES + ("/v1/policy-version", "/v1/update-weights")),
       raw=st.one_of(st.binary(max_size=200), st.builds(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}",
                                                       st.integers(100, 200_000)),
                     st.builds(lambda d: json.dumps(d).encode(), junk)),
       ctype=st.sampled_from(["application/json", "application/x-www-form-urlencoded", "text/plain", ""]))
def test_raw_bytes(api, route, raw, ctype):
    check(api.post(route, content=raw, headers={"content-type": ctype} if ctype else {}))


def test_the_server_still_answers(api):
    r = api.post("/v1/completions", json={"prompt": "t1 t2", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert api.get("/healthz").json()["status"] == "ok"
