"""Request bodies through a real uvicorn server on 127.0.0.1: JSON whatever the Content-Type (as
OpenAI-compatible servers take curl's default form type), and a 400 naming every field the server
would otherwise ignore; the official ``openai`` client keeps working."""

import json
import shutil
import subprocess

import pytest
from engine_fixtures import serve_api

CHAT = {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def api(smollm2):
    with serve_api(smollm2, budget=4) as client:
        yield client


def _text(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_json_body_without_json_content_type(api):
    want = _text(api.post("/v1/chat/completions", json=CHAT))
    raw = json.dumps(CHAT).encode()
    assert _text(api.post("/v1/chat/completions", content=raw)) == want  # no Content-Type at all
    form = {"content-type": "application/x-www-form-urlencoded"}  # curl -d's default
    assert _text(api.post("/v1/chat/completions", content=raw, headers=form)) == want
    r = api.post("/v1/completions", content=json.dumps({"prompt": "def f():", "max_tokens": 3}).encode(), headers=form)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = api.post("/v1/completions", content=b"prompt=hi&max_tokens=3", headers=form)  # a real form: not JSON
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    for body, needle in ((b"", "empty"), (b"[1, 2]", "JSON object")):
        r = api.post("/v1/chat/completions", content=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_the_readme_curl(api):
    """The README's command as written (curl -d: Content-Type application/x-www-form-urlencoded)."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    url = str(api.base_url).rstrip("/") + "/v1/chat/completions"
    out = subprocess.run(["curl", "-s", url, "-d", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"], out


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/completions", {"suffix": "return x"}, "suffix"),
    ("/v1/completions", {"echo": True}, "echo"),
])
def test_unsupported_openai_fields_answer_400_naming_them(api, path, extra, field):
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 2}
    r = api.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: not supported"), err
    assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("extra,field", [
    ({"tool_calls_please": 1}, "tool_calls_please"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ({"max_tokens": 4, "max_completion_tokens": 8}, "max_completion_tokens"),
])
def test_fields_that_would_be_ignored_answer_400(api, extra, field):
    r = api.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text


def test_fields_that_ask_for_nothing_are_accepted(api):
    want = _text(api.post("/v1/chat/completions", json=CHAT))
    noop = {"tools": [], "tool_choice": "none", "logit_bias": None, "store": False, "modalities": ["text"],
            "user": "u-1", "stream_options": None, "max_completion_tokens": 6}
    assert _text(api.post("/v1/chat/completions", json={**CHAT, **noop})) == want
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "primary colors."}]}]
    as_text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primary colors."}]
    assert _text(api.post("/v1/chat/completions", json={**CHAT, "messages": parts})) == \
        _text(api.post("/v1/chat/completions", json={**CHAT, "messages": as_text}))
    r = api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": False, "suffix": None})
    assert r.status_code == 200, r.text


def test_the_openai_client(api):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(api.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == _text(api.post("/v1/chat/completions", json=CHAT))
    assert chat.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=CHAT["messages"], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.choices)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=4, temperature=0, logprobs=1)
    assert comp.choices[0].text and len(comp.choices[0].logprobs.tokens) == 4
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=4, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
