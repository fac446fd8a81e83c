"""Damaged files in the data directory, against a real server process restarted over them: a
truncated manifest or data file is listed as `damaged` with the reason, counted, reported by
/v1/integrity, can be deleted and replaced, and never silently disappears; what the API says names
no server path."""

from __future__ import annotations

import json

from corpus_service.client import CorpusClient
from tests.corpus_service.service_fixtures import ServerProcess, wait_job

DOCS = {name: list(range(base, base + 40)) for name, base in (("a", 1000), ("b", 2000), ("c", 3000))}


def put(http, name, ids, **params):
    return http.put(f"/v1/namespaces/default/corpora/{name}", params={"format": "jsonl", **params},
                    content=json.dumps({"ids": ids}) + "\n")


def listed(http) -> dict:
    return {c["name"]: c for c in http.get("/v1/namespaces/default/corpora").json()}


def continues(srv, doc) -> bool:
    with CorpusClient(srv.target, "default", timeout=10.0) as c:
        c.start_request("probe", doc[:6])
        tokens = c.draft(["probe"], 6).tree(0)[0]
        c.finish("probe")
    return tokens[:3] == doc[6:9]


def test_damaged_manifests_and_data_files_are_reported_deletable_and_replaceable(tmp_path):
    srv = ServerProcess(tmp_path, "--snapshot-interval-s", "0").start()
    uploads = tmp_path / "uploads" / "default"
    try:
        with srv.http() as http:
            assert wait_job(http, put(http, "c", DOCS["c"]).json()["id"])["state"] == "done"
            assert http.post("/v1/snapshot").status_code == 200  # the snapshot holds c
            for name in ("a", "b"):
                assert wait_job(http, put(http, name, DOCS[name]).json()["id"])["state"] == "done"
        srv.kill()  # a and b live only in the data directory
        for name in ("a", "c"):  # truncated manifests
            path = uploads / f"{name}.json"
            path.write_bytes(path.read_bytes()[:25])
        data = uploads / "b.data"  # a truncated data file (cut at a line boundary: it would still parse)
        data.write_bytes(data.read_bytes().split(b",")[0] + b"]}\n")
        srv.start()
        with srv.http() as http:
            entries = listed(http)
            assert set(entries) == {"a", "b", "c"}, entries  # none vanished
            for name in ("a", "b", "c"):
                assert entries[name]["state"] == "damaged", entries[name]
            assert "manifest truncated" in entries["a"]["error"] and "nothing drafts" in entries["a"]["error"]
            assert "data file holds" in entries["b"]["error"]
            assert entries["c"]["tokens"] == 40 and "still drafts" in entries["c"]["error"]  # from the snapshot
            for e in entries.values():
                assert str(tmp_path) not in json.dumps(e)
            r = http.get("/v1/integrity")
            assert r.status_code == 500 and not r.json()["ok"]
            assert set(r.json()["corpora"]["default"]) == {"a", "b", "c"}
            assert str(tmp_path) not in r.text
            assert 'ngram_corpus_damaged_corpora_total{namespace="default"} 3.0' in http.get("/metrics").text
            assert continues(srv, DOCS["c"]) and not continues(srv, DOCS["b"])  # b was not half-built
            # Damaged entries can be deleted (a manifest that does not parse: 400 before) ...
            for name in ("a", "c"):
                r = http.delete(f"/v1/namespaces/default/corpora/{name}")
                assert r.status_code == 204, r.text
            assert not continues(srv, DOCS["c"])
            # ... and replaced (409 before, with no way out but deleting the files by hand).
            r = put(http, "b", DOCS["b"])
            assert r.status_code == 409 and "damaged" in r.json()["error"]["message"]
            r = put(http, "b", DOCS["b"], replace="true")
            assert r.status_code == 202, r.text
            assert wait_job(http, r.json()["id"])["state"] == "done"
            assert list(listed(http)) == ["b"] and listed(http)["b"]["state"] == "ready"
            r = http.get("/v1/integrity")
            assert r.status_code == 200 and r.json()["ok"], r.text
        assert continues(srv, DOCS["b"])
        # The damage was logged once per corpus, not per listing.
        assert srv.log().count("is damaged") == 3, srv.log()
    finally:
        if srv.alive():
            srv.stop()


def test_a_refused_snapshot_is_reported_without_the_server_path(tmp_path):
    srv = ServerProcess(tmp_path).start()
    srv.stop()  # writes the snapshots
    snap = tmp_path / "snapshots" / "default.ngc"
    snap.write_bytes(snap.read_bytes()[:40])
    srv.start()
    try:
        with srv.http() as http:
            err = http.get("/v1/namespaces/default").json()["snapshot_error"]
        assert "default.ngc" in err and "refused" in err
        assert str(tmp_path) not in err
    finally:
        srv.stop()
