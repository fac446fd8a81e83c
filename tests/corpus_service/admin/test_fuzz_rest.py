"""Hostile REST admin traffic against a live server (hypothesis): random and malformed upload
bodies (invalid UTF-8, wrong JSON types, huge/negative/out-of-vocabulary ids), traversal and
garbage corpus names, unknown namespaces, a gzip bomb, a truncated upload. Every answer is a JSON
4xx (or 202 for a valid upload), never a 5xx; nothing lands outside the data directory's own
files; the server stays alive with bounded memory. Example counts: NGRAM_HYPOTHESIS_EXAMPLES."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import socket
import time
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.corpus_service.server_health import assert_alive, rss_bytes
from tests.corpus_service.service_fixtures import TOKEN

EXAMPLES = int(os.environ.get("NGRAM_HYPOTHESIS_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
CLEAR = {202, 400, 404, 405, 409, 413, 422, 429}  # 429: the admin rate limit (on by default)
RSS_GROWTH_BOUND = 256 << 20
_names = itertools.count()
# Every file the server may create: its snapshots, uploads (NAME.data/.json, dot-prefixed partials
# and .tmp), and the test harness' logs and ports file.
_OWN_FILE = re.compile(r"^(snapshots/[a-z0-9_.-]+\.ngc(\.tmp|\.corrupt-\d+)?|uploads/(default|small|smollm2)/"
                       r"\.?[A-Za-z0-9][A-Za-z0-9_.-]*(\.data|\.json|\.json\.tmp|\.incoming)|ngram-corpus\.lock|server-\d+\.log|ports\.json(\.tmp)?)$",
                       re.IGNORECASE)


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def rss_before(server):
    return rss_bytes(server.proc.pid)


def put(http, ns: str, name: str, body: bytes, fmt: str = "jsonl", headers: dict | None = None):
    return http.put(f"/v1/namespaces/{ns}/corpora/{name}", params={"format": fmt}, content=body, headers=headers or {})


def check_answer(r, what, ok=frozenset()) -> None:
    assert r.status_code in CLEAR | ok, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] and err["message"], what


def check_data_dir(server) -> None:
    for path in server.data_dir.rglob("*"):
        if path.is_file():
            rel = path.relative_to(server.data_dir).as_posix()
            assert _OWN_FILE.match(rel), f"unexpected file in the data dir: {rel}"


# --------------------------------------------------------------------------- bodies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(["ids", "text", "x"]), inner, max_size=3),
    max_leaves=20)
hostile_docs = st.one_of(
    json_values,
    st.fixed_dictionaries({"ids": st.lists(st.one_of(st.integers(-(1 << 64), 1 << 64), st.integers(0, 1100)), max_size=30)}),
    st.fixed_dictionaries({"ids": st.lists(st.integers(0, 999), min_size=1, max_size=30)}),  # valid for 'small'
    st.fixed_dictionaries({"text": st.text(max_size=50)}),
)


@FUZZ
@given(body=st.binary(max_size=2048), fmt=st.sampled_from(["jsonl", "text", "ids", "bogus"]),
       ns=st.sampled_from(["default", "small", "nope"]))
def test_random_upload_bodies(server, http, rss_before, body, fmt, ns):
    r = put(http, ns, f"fzb{next(_names)}", body, fmt)
    check_answer(r, f"{ns} {fmt} {body!r:.100}")
    if ns == "nope":
        assert r.status_code == 404
    assert_alive(server, http=http)


@FUZZ
@given(docs=st.lists(hostile_docs, min_size=1, max_size=4), ns=st.sampled_from(["default", "small"]),
       bad_utf8=st.booleans())
def test_hostile_jsonl_documents(server, http, rss_before, docs, ns, bad_utf8):
    body = "".join(json.dumps(d) + "\n" for d in docs).encode()
    if bad_utf8:
        body = body[: len(body) // 2] + b"\xff\xfe" + body[len(body) // 2:]
    name = f"fzj{next(_names)}"
    r = put(http, ns, name, body)
    check_answer(r, f"{ns} {body!r:.200}")
    valid = not bad_utf8 and all(isinstance(d, dict) and isinstance(d.get("ids"), list) and all(
        type(t) is int and 0 <= t < (1000 if ns == "small" else 1 << 31) for t in d["ids"]) for d in docs)
    if valid and any(d["ids"] for d in docs):
        assert r.status_code in (202, 429), r.text
    elif not valid:
        assert r.status_code in (400, 429), r.text  # refused before acknowledgement: nothing stored
        assert http.get(f"/v1/namespaces/{ns}/corpora/{name}").status_code == 404
    assert_alive(server, http=http)


@FUZZ
@given(name=st.one_of(st.sampled_from(["..", "../../etc/passwd", "./x", ".hidden", "a/../b", "%2e%2e", "a\\b", "x" * 65,
                                       "nul\x00", "ok-name", "-dash", "é", " "]), st.text(min_size=1, max_size=80)),
       ns=st.sampled_from(["default", "small", "nope", "..", "%2e%2e"]))
def test_corpus_names_never_escape_the_data_dir(server, http, rss_before, name, ns):
    path_name = quote(name, safe="")
    r = http.put(f"/v1/namespaces/{quote(ns, safe='')}/corpora/{path_name}", params={"format": "ids"}, content=b"1 2 3\n")
    check_answer(r, f"{ns}/{name!r}")
    # (The client removes dot segments: a GET of ".." reads the namespace itself, hence 200.)
    url = f"/v1/namespaces/{quote(ns, safe='')}/corpora/{path_name}"
    check_answer(http.get(url), f"get {name!r}", ok={200})
    check_answer(http.delete(url), f"delete {name!r}", ok={204})
    check_data_dir(server)
    assert_alive(server, http=http)


def test_gzip_bomb_is_refused_not_inflated(server, http, rss_before):
    """The admin does not inflate request bodies: a gzip bomb is bytes that are not JSONL/ids/text,
    refused while streaming, and never expanded in memory."""
    bomb = gzip.compress(b"0 " * (32 << 20), compresslevel=6)  # 64 MiB of ids when inflated (~1000x)
    assert len(bomb) < 1_000_000  # it fits the fixture's max_upload_bytes
    for fmt in ("ids", "jsonl", "text"):
        r = put(http, "small", f"bomb-{fmt}", bomb, fmt, headers={"Content-Encoding": "gzip"})
        while r.status_code == 429:  # the admin rate limit, after the fuzzing above
            time.sleep(float(r.headers.get("Retry-After", "1")))
            r = put(http, "small", f"bomb-{fmt}", bomb, fmt, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 400, r.text
        assert http.get(f"/v1/namespaces/small/corpora/bomb-{fmt}").status_code == 404
    r = put(http, "small", "too-big", b"1 " * 600_000, "ids")
    assert r.status_code in (413, 429), r.text
    assert_alive(server, http=http)


def test_truncated_upload_is_not_acknowledged(server, http):
    """The client dies mid-upload (Content-Length promises more than arrives): no 202, nothing
    listed, the partial file is removed."""
    with socket.create_connection(("127.0.0.1", server.admin_port), timeout=30) as s:
        s.sendall((f"PUT /v1/namespaces/small/corpora/cut?format=ids HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100000\r\n\r\n").encode() + b"1 2 3\n" * 100)
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while list(server.data_dir.glob("uploads/small/.cut.*")):
        assert time.monotonic() < deadline, "the partial upload was never cleaned up"
        time.sleep(0.05)
    assert http.get("/v1/namespaces/small/corpora/cut").status_code == 404
    assert_alive(server, http=http)


def test_memory_stayed_bounded(server, rss_before):
    """Runs last in this module: everything above left the RSS bounded."""
    growth = rss_bytes(server.proc.pid) - rss_before
    assert growth < RSS_GROWTH_BOUND, f"server RSS grew by {growth >> 20} MiB"
