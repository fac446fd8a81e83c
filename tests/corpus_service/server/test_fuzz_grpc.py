"""Hostile gRPC traffic against a live server (hypothesis): garbage bytes to every RPC, corrupted
real messages, and well-formed messages with hostile field values. Every call gets a clear status
(never UNKNOWN or INTERNAL, which would mean an unhandled exception), the server stays alive, and
its memory stays bounded. Example counts: NGRAM_HYPOTHESIS_EXAMPLES."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.server.handlers import SERVICE
from tests.corpus_service.server_health import assert_alive, rss_bytes
from tests.corpus_service.service_fixtures import TOKEN

EXAMPLES = int(os.environ.get("NGRAM_HYPOTHESIS_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
C = grpc.StatusCode
CLEAR = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED, C.ALREADY_EXISTS}
RSS_GROWTH_BOUND = 256 << 20  # generous: the engines keep what valid examples commit, nothing more
METHODS = {m.name: m for m in SERVICE.methods}
ADMIN = (("authorization", f"Bearer {TOKEN}"),)  # the admin methods' handlers are fuzzed, not their refusal


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def health(server, channel):
    with server.http(token=None) as http:
        yield lambda: assert_alive(server, channel, http)


@pytest.fixture(scope="module")
def rss_before(server):
    return rss_bytes(server.proc.pid)


def call_raw(channel, method: str, payloads: list[bytes]):
    """Sends bytes as the request message(s); returns (status code, details, response bytes list)."""
    m = METHODS[method]
    path = f"/{SERVICE.full_name}/{method}"
    try:
        if m.client_streaming and m.server_streaming:
            out = list(channel.stream_stream(path)(iter(payloads), timeout=30, metadata=ADMIN))
        elif m.client_streaming:
            out = [channel.stream_unary(path)(iter(payloads), timeout=30, metadata=ADMIN)]
        else:
            out = [channel.unary_unary(path)(payloads[0], timeout=30, metadata=ADMIN)]
        return C.OK, "", out
    except grpc.RpcError as e:
        return e.code(), e.details(), []


def check_clear(code, details, what) -> None:
    assert code in CLEAR, f"{what}: {code} {details}"
    if code != C.OK:
        assert details, f"{what}: {code} without a message"


def check_session_replies(replies: list[bytes], what) -> None:
    for raw in replies:
        resp = pb.SessionResponse.FromString(raw)
        if resp.HasField("error"):
            code = next(c for c in C if c.value[0] == resp.error.code)
            check_clear(code, resp.error.message, what)


# --------------------------------------------------------------------------- hostile messages

i32 = st.integers(-(1 << 31), (1 << 31) - 1)
tokens = st.one_of(st.lists(i32, max_size=40), st.lists(st.integers(0, 1100), max_size=40))
namespaces = st.sampled_from(["default", "small", "nope", "", "../default", "small\x00", "x" * 300])
req_ids = st.lists(st.one_of(st.sampled_from(["a", "b", "0"]), st.text(max_size=300)), max_size=6)


@st.composite
def token_runs(draw) -> pb.TokenRuns:
    ids = draw(req_ids)
    if draw(st.booleans()):  # consistent lengths and tokens: the hostile part is the values
        runs = [draw(tokens) for _ in ids]
        return pb.TokenRuns(req_ids=ids, lengths=np.array([len(r) for r in runs], "<i4").tobytes(),
                            tokens=np.array([t for r in runs for t in r], "<i4").tobytes())
    return pb.TokenRuns(req_ids=ids, lengths=draw(st.binary(max_size=64)), tokens=draw(st.binary(max_size=256)))


@st.composite
def session_requests(draw) -> pb.SessionRequest:
    return pb.SessionRequest(
        seq=draw(st.integers(0, (1 << 64) - 1)), namespace=draw(namespaces),
        restore=draw(token_runs()), start=draw(token_runs()), extend=draw(token_runs()),
        finish=draw(req_ids), draft=pb.DraftRequest(req_ids=draw(req_ids), budget=draw(i32)))


@st.composite
def unary_requests(draw) -> tuple[str, bytes]:
    method = draw(st.sampled_from(["BatchGet", "BatchPut", "EraseMatchState", "CommitExternalCorpus",
                                   "RemoveExternalCorpus", "ListExternalCorpora", "Stats"]))
    ns = draw(namespaces)
    name = draw(st.one_of(st.sampled_from(["docs", "../etc/passwd", "..", ".hidden", "a/b", ""]), st.text(max_size=80)))
    if method == "BatchGet":
        runs = draw(token_runs())
        msg = pb.BatchGetRequest(namespace=ns, client_id=draw(st.text(max_size=200)), windows=runs,
                                 total_lens=draw(st.one_of(
                                     st.binary(max_size=64),
                                     st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=len(runs.req_ids),
                                              max_size=len(runs.req_ids)).map(lambda v: np.array(v, "<i8").tobytes()))),
                                 draft_token_num=draw(i32))
    elif method == "BatchPut":
        runs = draw(token_runs())
        msg = pb.BatchPutRequest(namespace=ns, lengths=runs.lengths, tokens=runs.tokens, synchronize=draw(st.booleans()))
    elif method == "EraseMatchState":
        msg = pb.EraseMatchStateRequest(namespace=ns, client_id=draw(st.text(max_size=200)), req_ids=draw(req_ids))
    elif method == "CommitExternalCorpus":
        msg = pb.CommitExternalCorpusRequest(namespace=ns, name=name, expected_tokens=draw(st.integers(-(1 << 63), (1 << 63) - 1)))
    elif method == "RemoveExternalCorpus":
        msg = pb.RemoveExternalCorpusRequest(namespace=ns, name=name)
    elif method == "ListExternalCorpora":
        msg = pb.ListExternalCorporaRequest(namespace=ns)
    else:
        msg = pb.StatsRequest(namespace=ns)
    return method, msg.SerializeToString()


def mutate(data: bytes, draw) -> bytes:
    """A real message with bytes flipped, cut, or spliced: what a corrupting network or a buggy
    encoder produces."""
    how = draw(st.sampled_from(["flip", "truncate", "splice", "same"]))
    if not data or how == "same":
        return data
    if how == "flip":
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    i = draw(st.integers(0, len(data)))
    return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]


# --------------------------------------------------------------------------- tests


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payloads=st.lists(st.binary(max_size=512), min_size=1, max_size=3))
def test_garbage_bytes_to_every_rpc(server, channel, health, rss_before, method, payloads):
    code, details, out = call_raw(channel, method, payloads)
    check_clear(code, details, f"{method} {payloads!r:.200}")
    if method == "Session":
        check_session_replies(out, method)
    health()


@FUZZ
@given(data=st.data())
def test_hostile_unary_messages(server, channel, health, rss_before, data):
    method, raw = data.draw(unary_requests())
    raw = mutate(raw, data.draw)
    code, details, _ = call_raw(channel, method, [raw])
    check_clear(code, details, f"{method} {raw!r:.200}")
    health()


@FUZZ
@given(data=st.data())
def test_hostile_session_streams(server, channel, health, rss_before, data):
    msgs = [mutate(data.draw(session_requests()).SerializeToString(), data.draw)
            for _ in range(data.draw(st.integers(1, 3)))]
    code, details, out = call_raw(channel, "Session", msgs)
    check_clear(code, details, f"Session {msgs!r:.200}")
    check_session_replies(out, "Session")
    health()


@FUZZ
@given(data=st.data())
def test_hostile_external_corpus_loads(server, channel, health, rss_before, data):
    chunks = []
    for _ in range(data.draw(st.integers(1, 3))):
        msg = pb.ExternalChunk(namespace=data.draw(namespaces), name=data.draw(st.sampled_from(["fz", "..", "a/b", ""])),
                               tokens=data.draw(st.one_of(st.binary(max_size=64), tokens.map(lambda t: np.array(t, "<i4").tobytes()))))
        chunks.append(mutate(msg.SerializeToString(), data.draw))
    code, details, _ = call_raw(channel, "LoadExternalCorpus", chunks)
    check_clear(code, details, f"LoadExternalCorpus {chunks!r:.200}")
    # A load never commits by itself: nothing half-loaded is visible, and the name stays free.
    listed = pb.ListExternalCorporaResponse.FromString(call_raw(channel, "ListExternalCorpora", [
        pb.ListExternalCorporaRequest(namespace="small").SerializeToString()])[2][0])
    assert "fz" not in listed.corpora
    health()


def test_oversized_and_overflowing_messages(server, channel, health):
    huge_batch = pb.SessionRequest(seq=1, namespace="small", draft=pb.DraftRequest(req_ids=[str(i) for i in range(100_000)], budget=4))
    code, details, out = call_raw(channel, "Session", [huge_batch.SerializeToString()])
    assert code == C.OK and pb.SessionResponse.FromString(out[0]).error.code == C.RESOURCE_EXHAUSTED.value[0]
    too_big = pb.BatchPutRequest(namespace="default", lengths=np.array([1 << 24], "<i4").tobytes(), tokens=b"\0" * (70 << 20))
    code, details, _ = call_raw(channel, "BatchPut", [too_big.SerializeToString()])
    assert code == C.RESOURCE_EXHAUSTED, details
    # A compressed bomb: 80 MiB of zeros sent gzip-compressed (~80 KiB on the wire). The limit applies
    # to the inflated message.
    with grpc.insecure_channel(server.target, compression=grpc.Compression.Gzip,
                               options=[("grpc.max_send_message_length", 128 << 20)]) as gz:
        bomb = pb.BatchPutRequest(namespace="default", lengths=np.array([20 << 20], "<i4").tobytes(), tokens=b"\0" * (80 << 20))
        code, details, _ = call_raw(gz, "BatchPut", [bomb.SerializeToString()])
        assert code == C.RESOURCE_EXHAUSTED, (code, details)
    # Lengths whose int32 sum would overflow, and a run claiming more tokens than the message holds.
    lens = np.array([(1 << 31) - 1, (1 << 31) - 1, 5], "<i4").tobytes()
    code, details, _ = call_raw(channel, "BatchPut", [pb.BatchPutRequest(namespace="default", lengths=lens, tokens=b"\1\0\0\0").SerializeToString()])
    assert code == C.INVALID_ARGUMENT, details
    # An unknown length-delimited field (skipped), 5000 nested unknown groups (past the parser's
    # recursion limit), and a tag with an out-of-range field number.
    for raw in (b"\x2a\x02\x0a\x00", b"\x0b" * 5000 + b"\x0c" * 5000, b"\xfa\xff\xff\xff\x0f" + b"\x00" * 8):
        code, details, _ = call_raw(channel, "Stats", [raw])
        check_clear(code, details, repr(raw[:20]))
    health()


def test_memory_stayed_bounded(server, rss_before):
    """Runs last in this module (pytest keeps file order): everything above left the RSS bounded."""
    growth = rss_bytes(server.proc.pid) - rss_before
    assert growth < RSS_GROWTH_BOUND, f"server RSS grew by {growth >> 20} MiB"
