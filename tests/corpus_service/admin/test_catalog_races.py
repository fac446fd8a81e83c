"""Concurrent writers of one corpus name against a real server process: one winner, clear 404/409
for the others, never a 500; temp files unique per writer and cleaned up; no answer carries a
server path."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.corpus_service.service_fixtures import TOKEN, ServerProcess, wait_job

WRITERS = 16


def _client(srv) -> httpx.Client:
    return httpx.Client(base_url=srv.admin_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60.0)


def _all_at_once(srv, calls) -> list[httpx.Response]:
    """Runs the calls from WRITERS threads, each with its own connection, released together."""
    clients = [_client(srv) for _ in calls]
    try:
        for c in clients:
            c.get("/healthz")  # connected before the race starts
        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(lambda cc: cc[1](cc[0]), zip(clients, calls)))
    finally:
        for c in clients:
            c.close()


def _check_clean(srv, responses, allowed) -> None:
    for r in responses:
        assert r.status_code in allowed, (r.status_code, r.text)
        if r.status_code >= 400:
            body = r.json()
            assert set(body) == {"error"} and body["error"]["message"], body
        assert str(srv.data_dir) not in r.text, r.text  # no server path in any answer
    leftovers = [p.name for p in (srv.data_dir / "uploads").glob("*/.*") if not p.name.endswith(".incoming")]
    assert not leftovers, leftovers  # every writer's temp file is gone


def test_concurrent_deletes_and_uploads_of_one_name(tmp_path):
    srv = ServerProcess(tmp_path, "--admin-rate-per-s", "0", "--snapshot-interval-s", "0").start()
    body = json.dumps({"ids": list(range(100, 140))}) + "\n"
    try:
        for round_ in range(4):
            name = f"docs{round_}"
            with _client(srv) as http:
                r = http.put(f"/v1/namespaces/default/corpora/{name}", params={"format": "jsonl"}, content=body)
                assert r.status_code == 202, r.text
                wait_job(http, r.json()["id"])
            # Every writer deletes the same corpus: one 204, the rest 404 (it is gone) or 409 (in use).
            rs = _all_at_once(srv, [lambda c, n=name: c.delete(f"/v1/namespaces/default/corpora/{n}")] * WRITERS)
            _check_clean(srv, rs, {204, 404, 409})
            assert [r.status_code for r in rs].count(204) == 1, [r.status_code for r in rs]
            # Every writer uploads the same name: one 202, the rest 409.
            rs = _all_at_once(srv, [lambda c, n=name: c.put(f"/v1/namespaces/default/corpora/{n}",
                                                            params={"format": "jsonl"}, content=body)] * WRITERS)
            _check_clean(srv, rs, {202, 409})
            assert [r.status_code for r in rs].count(202) == 1, [r.status_code for r in rs]
            # Uploads and deletes mixed: whatever the order, clear answers and a consistent catalog.
            mixed = [lambda c, n=name: c.delete(f"/v1/namespaces/default/corpora/{n}"),
                     lambda c, n=name: c.put(f"/v1/namespaces/default/corpora/{n}", params={"format": "jsonl",
                                                                                           "replace": "true"},
                                             content=body)] * (WRITERS // 2)
            rs = _all_at_once(srv, mixed)
            _check_clean(srv, rs, {202, 204, 404, 409})
            with _client(srv) as http:
                for r in rs:
                    if r.status_code == 202:
                        wait_job(http, r.json()["id"])
                entry = {c["name"]: c for c in http.get("/v1/namespaces/default/corpora").json()}.get(name)
                assert entry is None or entry["state"] == "ready", entry
                assert http.get("/v1/integrity").json()["ok"]
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
