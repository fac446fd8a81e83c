"""Hostile inputs for bench/fuzz_load.py: malformed and out-of-range messages to every gRPC method,
and hostile REST requests (names, bodies, credentials). Deterministic for a seed.

Every case must get a clear answer: a gRPC status other than UNKNOWN/INTERNAL, an HTTP status
below 500. ``run_grpc`` / ``run_rest`` count the answers and keep the unclear ones.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from urllib.parse import quote

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.protocol import arrays
from corpus_service.server.handlers import SERVICE

METHODS = {m.name: m for m in SERVICE.methods}
UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def _batch_get(rng: random.Random) -> pb.BatchGetRequest:
    n = rng.choice([0, 1, 3, 1025])
    ids = [rng.choice(["r", "", "x" * 300, "dup"]) + str(rng.randrange(3)) for _ in range(n)]
    req = pb.BatchGetRequest(namespace=rng.choice(["default", "nope", ""]), draft_token_num=rng.choice([0, 1, 8, 1 << 20]),
                             client_id=rng.choice(["c", "a/b", "x" * 200, "nl\n"]))
    runs = [np.array([rng.choice([-1, 0, 5, 1 << 30]) for _ in range(rng.randrange(0, 4))], np.int32) for _ in ids]
    arrays.pack_runs(req.windows, ids, runs)
    req.total_lens = arrays.pack([rng.choice([-5, 0, 2, 1 << 40]) for _ in range(max(0, n + rng.choice([-1, 0, 0, 1])))],
                               arrays.I64)
    return req


def _session_step(rng: random.Random, seq: int) -> pb.SessionRequest:
    msg = pb.SessionRequest(seq=seq, namespace=rng.choice(["default", "default", "nope"]))
    kind = rng.randrange(5)
    if kind == 0:
        arrays.pack_runs(msg.start, ["a", "a"], [np.arange(3, dtype=np.int32)] * 2)  # duplicate ids
    elif kind == 1:
        arrays.pack_runs(msg.start, [f"s{seq}"], [np.array([-3, (1 << 31) - 1], np.int32)])  # bad token ids
    elif kind == 2:
        arrays.pack_runs(msg.extend, ["never-started"], [np.arange(4, dtype=np.int32)])
    elif kind == 3:
        msg.start.req_ids.append("short")
        msg.start.lengths = arrays.pack([1 << 30])  # claims more tokens than it carries
    else:
        msg.draft.req_ids.extend(["ghost"] * 2)
        msg.draft.budget = rng.choice([0, -1, 1 << 20])
    return msg


def grpc_cases(seed: int, count: int) -> list[tuple[str, list[bytes]]]:
    """(method, serialized request messages) pairs."""
    rng = random.Random(seed)
    cases: list[tuple[str, list[bytes]]] = []
    names = sorted(METHODS)
    while len(cases) < count:
        kind = rng.randrange(6)
        if kind == 0:  # garbage bytes to any method
            cases.append((rng.choice(names), [rng.randbytes(rng.randrange(0, 512))]))
        elif kind == 1:
            cases.append(("BatchGet", [_batch_get(rng).SerializeToString()]))
        elif kind == 2:
            cases.append(("Session", [_session_step(rng, i).SerializeToString() for i in range(rng.randrange(1, 6))]))
        elif kind == 3:
            put = pb.BatchPutRequest(namespace="default", lengths=rng.randbytes(rng.choice([3, 4, 8])),
                                     tokens=rng.randbytes(rng.choice([0, 7, 16])))
            cases.append(("BatchPut", [put.SerializeToString()]))
        elif kind == 4:
            erase = pb.EraseMatchStateRequest(namespace="default", client_id=rng.choice(["c", "a/b"]),
                                              req_ids=["" if rng.random() < 0.3 else "r"] * rng.choice([1, 2, 2000]))
            cases.append(("EraseMatchState", [erase.SerializeToString()]))
        else:
            chunk = pb.ExternalChunk(namespace="default", name=rng.choice(["nl\n", "../x", "ok", "x" * 300]),
                                               tokens=rng.randbytes(rng.choice([3, 8])))
            cases.append(("LoadExternalCorpus", [chunk.SerializeToString()]))
    return cases


# Admin methods need the admin token: half the cases send it, so they reach the handlers' input checks
# (the other half check that a caller without it is refused).
ADMIN_METHODS = {"Reset", "LoadExternalCorpus", "CommitExternalCorpus", "RemoveExternalCorpus"}


def run_grpc(channel: grpc.Channel, cases: list[tuple[str, list[bytes]]], deadline: float,
             admin_token: str | None = None) -> dict:
    codes: Counter = Counter()
    unclear: list[str] = []
    for i, (method, payloads) in enumerate(cases):
        metadata = None
        if admin_token and method in ADMIN_METHODS and i % 2 == 0:
            metadata = (("authorization", f"Bearer {admin_token}"),)
        if time.monotonic() > deadline:
            break
        m = METHODS[method]
        path = f"/{SERVICE.full_name}/{method}"
        try:
            if m.client_streaming and m.server_streaming:
                list(channel.stream_stream(path)(iter(payloads), timeout=30, metadata=metadata))
            elif m.client_streaming:
                channel.stream_unary(path)(iter(payloads), timeout=30, metadata=metadata)
            else:
                channel.unary_unary(path)(payloads[0], timeout=30, metadata=metadata)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            if code in UNCLEAR:
                unclear.append(f"{method}: {code.name} {e.details()!r:.200}")
        codes[code.name] += 1
    return {"cases": sum(codes.values()), "codes": dict(codes), "unclear": unclear}


def rest_cases(seed: int, count: int) -> list[tuple[str, str, dict]]:
    """(HTTP method, path, httpx keyword arguments) triples."""
    rng = random.Random(seed)
    names = ["evil%0A", "nl%0D%0A", "..%2F..%2Fetc", "x" * 300, "nul%00", "ok-" + str(seed), "%C3%A9", "a%2Fb", "-", " "]
    deep = ("[" * 50_000 + "]" * 50_000).encode()
    bodies = [b'{"text": "fine"}\n', b'{"ids": [1, 2, 3]}\n', b'{"text": ' + deep + b"}\n", b"\xff\xfe\x00garbage",
              json.dumps({"ids": [-1, 1 << 40]}).encode() + b"\n", b"1 2 3\n", b""]
    cases: list[tuple[str, str, dict]] = []
    while len(cases) < count:
        ns = rng.choice(["default", "nope", "%2E%2E", "x" * 100])
        name = rng.choice(names)
        auth = rng.choice([True, True, False])
        kind = rng.randrange(5)
        if kind == 0:
            cases.append(("PUT", f"/v1/namespaces/{ns}/corpora/{name}",
                          {"params": {"format": rng.choice(["jsonl", "ids", "text", "bogus"])},
                           "content": rng.choice(bodies), "auth": auth}))
        elif kind == 1:
            cases.append(("DELETE", f"/v1/namespaces/{ns}/corpora/{name}", {"auth": auth}))
        elif kind == 2:
            cases.append(("GET", rng.choice([f"/v1/namespaces/{ns}/corpora/{name}", f"/v1/jobs/{quote(name)}",
                                             f"/v1/namespaces/{ns}", "/v1/stats", "/metrics", "/v1/integrity",
                                             "/v1/" + "a/" * 200]), {"auth": auth}))
        elif kind == 3:
            cases.append(("POST", rng.choice(["/v1/snapshot", "/v1/stats", "/v1/namespaces"]),
                          {"content": rng.randbytes(64), "auth": auth}))
        else:
            cases.append(("GET", "/v1/stats", {"headers": {"Authorization": rng.choice(["Bearer x", "Basic Zm9v", "Bearer "
                                                                                       + "y" * 5000])}, "auth": False}))
    return cases


def run_rest(http, token: str, cases: list[tuple[str, str, dict]], deadline: float) -> dict:
    statuses: Counter = Counter()
    unclear: list[str] = []
    for method, path, kw in cases:
        if time.monotonic() > deadline:
            break
        kw = dict(kw)
        headers = dict(kw.pop("headers", {}))
        if kw.pop("auth"):
            headers["Authorization"] = f"Bearer {token}"
        r = http.request(method, path, headers=headers, **kw)
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            unclear.append(f"{method} {path[:80]}: {r.status_code} {r.text[:200]!r}")
        elif r.status_code == 429:  # the admin rate limit: wait as told, like a client would
            time.sleep(min(1.0, float(r.headers.get("Retry-After", "0.1"))))
    return {"cases": sum(statuses.values()), "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "unclear": unclear}
