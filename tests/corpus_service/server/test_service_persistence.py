"""Restarts keep everything acknowledged: SIGTERM (drain + snapshot) and kill -9 (uploads rebuilt
from their fsync'd files; deletions stay deleted); a corrupt snapshot is reported, not half-loaded."""

from __future__ import annotations

import json
import time

from corpus_service.client import CorpusClient
from tests.corpus_service.service_fixtures import ServerProcess, wait_job

DOC = list(range(500, 560))
LEARNED = list(range(700, 760))


def upload(srv, name, ids):
    with srv.http() as http:
        r = http.put(f"/v1/namespaces/default/corpora/{name}", params={"format": "jsonl"},
                     content=json.dumps({"ids": ids}) + "\n")
        assert r.status_code == 202, r.text
        return r.json()["id"]


def corpora(srv) -> dict:
    with srv.http() as http:
        return {c["name"]: c for c in http.get("/v1/namespaces/default/corpora").json()}


def wait_ready(srv, name, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        c = corpora(srv).get(name)
        if c and c["state"] == "ready":
            return c
        assert time.monotonic() < deadline, corpora(srv)
        time.sleep(0.02)


def drafts_continue(srv, context, expect) -> bool:
    with CorpusClient(srv.target) as c:
        c.start_request("probe", context)
        return c.draft(["probe"], len(expect)).tree(0)[0][: len(expect)] == expect


def test_sigterm_snapshot_then_kill9_keeps_acknowledged_uploads(tmp_path):
    srv = ServerProcess(tmp_path).start()
    with srv.http() as http:
        assert wait_job(http, upload(srv, "built", DOC))["state"] == "done"
    with CorpusClient(srv.target) as c:
        c.start_request("r", [1, 2])
        c.extend("r", LEARNED)
        c.finish("r")
        c.synchronize()
    assert srv.stop() == 0  # SIGTERM: drain and snapshot
    assert (tmp_path / "snapshots" / "default.ngc").exists()

    srv = ServerProcess(tmp_path).start()
    assert corpora(srv)["built"]["tokens"] == len(DOC)
    assert drafts_continue(srv, DOC[:8], DOC[8:12])
    assert drafts_continue(srv, LEARNED[:8], LEARNED[8:12])  # the learned corpus came back too

    # kill -9 right after the acknowledgement: the upload is rebuilt from its file on restart.
    upload(srv, "acked", list(range(900, 940)))
    with srv.http() as http:
        assert http.delete("/v1/namespaces/default/corpora/built").status_code == 204
    srv.kill()
    srv = ServerProcess(tmp_path).start()
    wait_ready(srv, "acked")
    assert "built" not in corpora(srv)  # the tombstone beat the older snapshot
    assert drafts_continue(srv, list(range(900, 908)), list(range(908, 912)))
    assert not drafts_continue(srv, DOC[:8], DOC[8:12])
    srv.stop()


def test_corrupt_snapshot_is_reported_and_moved_aside(tmp_path):
    srv = ServerProcess(tmp_path).start()
    srv.stop()
    snap = tmp_path / "snapshots" / "default.ngc"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    srv = ServerProcess(tmp_path).start()
    try:
        with srv.http() as http:
            ns = http.get("/v1/namespaces/default").json()
        assert "refused" in ns["snapshot_error"]
        assert "refused" in srv.log()
        assert list((tmp_path / "snapshots").glob("default.ngc.corrupt-*"))
    finally:
        srv.stop()
