"""Per-caller state on a real server is bounded and reclaimed: BatchGet client ids and their request
ids (limits, idle expiry, EraseMatchState), the server-wide live-request budget across sessions and
BatchGet clients (refusal with RESOURCE_EXHAUSTED, recovery when requests end), and a Session
cancelled while its client is not reading ends without a traceback."""

from __future__ import annotations

import time

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import CorpusClient
from corpus_service.engine.config import CorpusConfig
from corpus_service.protocol import arrays
from corpus_service.server.batch_clients import BatchClients, Held, held_after
from corpus_service.server.config import ServiceConfig
from corpus_service.server.live_budget import REQUEST_CHARGE_BYTES, LiveBudget, token_charge_bytes
from tests.corpus_service.service_fixtures import ServerProcess

RE = grpc.StatusCode.RESOURCE_EXHAUSTED
TOKEN_BYTES = token_charge_bytes(CorpusConfig())
BUDGET = 4 << 20
PROMPT = list(range(4000))
PER_REQUEST = REQUEST_CHARGE_BYTES + len(PROMPT) * TOKEN_BYTES  # 204,192 B: 20 fit in the budget


def metrics(srv: ServerProcess) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the server's /metrics."""
    text = httpx.get(f"{srv.admin_url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def limit_used(srv: ServerProcess, limit: str) -> float:
    return metrics(srv)[("ngram_corpus_limit_used", (("limit", limit),))]


def live_requests(srv: ServerProcess) -> float:
    return metrics(srv)[("ngram_corpus_live_requests", (("namespace", "default"),))]


def batch_get(stub, client_id: str, ids: list[str], window: int = 8, total: int | None = None):
    rng = np.random.default_rng(len(ids))
    req = pb.BatchGetRequest(namespace="default", client_id=client_id, draft_token_num=4,
                             total_lens=arrays.pack(np.full(len(ids), total or window, np.int64), arrays.I64))
    arrays.pack_runs(req.windows, ids, [rng.integers(0, 1000, window).astype(np.int32) for _ in ids])
    return stub.BatchGet(req, timeout=30)


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kwargs)
    assert e.value.code() == RE, e.value.details()
    return e.value.details()


def wait_until(pred, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("limits"), "--namespace", "default",
                        "--max-batch-get-clients", "4", "--max-batch-get-requests-per-client", "100",
                        "--batch-get-idle-s", "1", "--max-live-request-bytes", str(BUDGET))
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


def test_config_refuses_out_of_range_limits():
    for bad in ({"max_live_request_bytes": 0}, {"max_batch_get_clients": 0},
                {"max_batch_get_requests_per_client": True}, {"batch_get_idle_s": 0}, {"batch_get_idle_s": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServiceConfig(admin_port=-1, **bad)


def test_batch_get_records_follow_the_engine_rule_and_settle_exactly():
    """The registry's own arithmetic (no server): what it charges is what it later releases."""
    assert held_after(None, 5, 50, 1000) == 5  # new: the window
    assert held_after(Held(10, 100, 0.0), 5, 103, 1000) == 13  # continues: 3 fresh tokens
    assert held_after(Held(10, 100, 0.0), 5, 50, 1000) == 5  # rewound: starts over
    assert held_after(Held(998, 100, 0.0), 5, 103, 1000) == 5  # past max_request_tokens: the window
    budget = LiveBudget(1 << 30)
    clients = BatchClients(budget, max_clients=4, max_requests_per_client=100, idle_s=60)
    c = clients.client("ns", "u:a/")
    first = clients.admit(c, ["r1", "r2"], np.array([8, 8]), np.array([8, 8]), 10, 1000)
    overlapping = clients.admit(clients.client("ns", "u:a/"), ["r1"], np.array([4]), np.array([12]), 10, 1000)
    clients.settle(first, True, 10, 1000)
    clients.settle(overlapping, True, 10, 1000)
    assert c.requests["r1"].tokens == 12 and c.users == 0
    assert budget.used == c.charged == 2 * REQUEST_CHARGE_BYTES + (12 + 8) * 10
    failed = clients.admit(clients.client("ns", "u:a/"), ["r3"], np.array([8]), np.array([8]), 10, 1000)
    assert clients.settle(failed, False, 10, 1000) == ["u:a/r3"]  # the engine may hold it: erase it
    assert budget.used == c.charged
    with pytest.raises(Exception, match="max_batch_get_requests_per_client = 100"):
        clients.admit(clients.client("ns", "u:a/"), [f"x{i}" for i in range(99)], np.full(99, 8), np.full(99, 8), 10, 1000)
    assert budget.used == c.charged  # refused: nothing reserved
    clients.done(c)
    assert clients.expire({"ns": 10}, now=time.monotonic() + 61) == [("ns", ["u:a/r2", "u:a/r1"])]
    assert budget.used == 0 and len(clients) == 0 and clients.num_requests == 0


def test_batch_get_state_is_bounded_per_client_and_in_total_then_expires(limited):
    with grpc.insecure_channel(limited.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        for c in range(4):
            batch_get(stub, f"c{c}", [f"r{i}" for i in range(50)])
        msg = refused(batch_get, stub, "c4", ["r0"])  # a fifth client id
        assert "max_batch_get_clients = 4" in msg
        msg = refused(batch_get, stub, "c0", [f"n{i}" for i in range(51)])  # 50 + 51 > 100 ids
        assert "max_batch_get_requests_per_client = 100" in msg
        batch_get(stub, "c0", [f"r{i}" for i in range(50)], window=4, total=12)  # known ids: no new room needed
        m = metrics(limited)
        assert m[("ngram_corpus_limit_used", (("limit", "batch_get_clients"),))] == 4
        assert m[("ngram_corpus_limit_refused_total", (("limit", "batch_get_clients"),))] >= 1
        assert m[("ngram_corpus_limit_refused_total", (("limit", "batch_get_requests_per_client"),))] >= 1
        assert live_requests(limited) == 200
        # Idle for batch_get_idle_s: every request id and client id is reclaimed without another call.
        wait_until(lambda: live_requests(limited) == 0)
        assert limit_used(limited, "batch_get_clients") == 0
        assert limit_used(limited, "live_request_bytes") == 0
        assert metrics(limited)[("ngram_corpus_batch_get_expired_requests_total", ())] >= 200
        batch_get(stub, "c4", ["r0"])  # room again


def test_erase_match_state_frees_a_clients_room(limited):
    with grpc.insecure_channel(limited.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        ids = [f"e{i}" for i in range(100)]
        batch_get(stub, "eraser", ids)
        refused(batch_get, stub, "eraser", ["one-more"])
        stub.EraseMatchState(pb.EraseMatchStateRequest(namespace="default", client_id="eraser", req_ids=ids), timeout=30)
        batch_get(stub, "eraser", [f"f{i}" for i in range(100)])


def test_live_request_budget_spans_sessions_and_batch_get_and_recovers(limited):
    wait_until(lambda: limit_used(limited, "live_request_bytes") == 0)
    with CorpusClient(limited.target, timeout=10) as a, CorpusClient(limited.target, timeout=10) as b, \
            grpc.insecure_channel(limited.target) as ch:
        for i in range(15):
            a.start_request(f"a{i}", PROMPT)
        a.flush()
        assert limit_used(limited, "live_request_bytes") == 15 * PER_REQUEST
        for i in range(15):  # another session: the budget is server-wide
            b.start_request(f"b{i}", PROMPT)
        with pytest.raises(Exception) as e:
            b.flush()
        assert e.value.code == RE and f"max_live_request_bytes = {BUDGET}" in str(e.value), e.value
        msg = refused(batch_get, pb_grpc.CorpusStub(ch), "bg", [f"x{i}" for i in range(100)], window=400)
        assert "max_live_request_bytes" in msg
        assert limit_used(limited, "live_request_bytes") == 15 * PER_REQUEST  # refusals charged nothing
        for i in range(15):  # finishing frees the budget: the other session gets in
            a.finish(f"a{i}")
        a.flush()
        assert limit_used(limited, "live_request_bytes") == 0
        for i in range(15):
            b.start_request(f"b{i}", PROMPT)
        b.flush()
        for i in range(15):  # commits are charged too: one request cannot grow past the budget
            b.extend(f"b{i}", list(range(100)))
        b.flush()
        assert limit_used(limited, "live_request_bytes") == 15 * (PER_REQUEST + 100 * TOKEN_BYTES)
        b.extend("b0", list(range(60000)))
        with pytest.raises(Exception) as e:
            b.flush()
        assert e.value.code == RE
    # Closed streams release whatever their requests held.
    wait_until(lambda: limit_used(limited, "live_request_bytes") == 0)
    assert metrics(limited)[("ngram_corpus_limit_refused_total", (("limit", "live_request_bytes"),))] >= 3


def test_a_step_that_finishes_requests_is_admitted_at_the_limit(limited):
    wait_until(lambda: limit_used(limited, "live_request_bytes") == 0)
    with CorpusClient(limited.target, timeout=10) as a:
        for i in range(BUDGET // PER_REQUEST):
            a.start_request(f"a{i}", PROMPT)
        a.flush()
        a.start_request("late", PROMPT)
        with pytest.raises(Exception):
            a.flush()
        a.finish("a0")  # the same step ends one request and starts another
        a.start_request("late", PROMPT)
        a.flush()
        assert a.has_request("late") and not a.has_request("a0")


def test_cancelled_session_ends_quietly(limited):
    """A client that stops reading and cancels: no traceback in the server's log, its requests end."""
    prompt = np.random.default_rng(0).integers(0, 50, 900).astype(np.int32)

    def steps():
        first = pb.SessionRequest(seq=0, namespace="default")
        arrays.pack_runs(first.start, ["a"], [prompt])
        yield first
        for seq in range(1, 200_000):
            msg = pb.SessionRequest(seq=seq, namespace="default")
            msg.draft.req_ids.append("a")
            msg.draft.budget = 64
            yield msg

    wait_until(lambda: live_requests(limited) == 0)
    before = len(limited.log_path.read_text(errors="replace"))
    with grpc.insecure_channel(limited.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        for _ in range(3):
            call = stub.Session(steps())  # never read: the server's writes back up
            time.sleep(2.0)
            call.cancel()
    wait_until(lambda: live_requests(limited) == 0)
    time.sleep(1.0)  # gRPC logs a failed handler after the handler's own cleanup
    log = limited.log_path.read_text(errors="replace")[before:]
    assert "Traceback" not in log and "ERROR" not in log, log
    assert limit_used(limited, "live_request_bytes") == 0
    assert metrics(limited)[("ngram_corpus_sessions_cancelled_total", ())] >= 1
