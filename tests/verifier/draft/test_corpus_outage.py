"""A corpus outage is said once when it starts and once when it ends (log line, outage counter,
/healthz field), never once per step, in the verifier and in its client process; real corpus
servers killed and restarted on the same 127.0.0.1 port."""

import logging
import time

import pytest
from engine_fixtures import serve_api

from tests.corpus_service.service_fixtures import ServerProcess
from verifier.draft.calls import Extend, StartRequest
from verifier.draft.corpus_process import REACHABLE_NOTE, Note, ClientProcess, ClientSettings
from verifier.draft.drafter import DraftConfig, Drafter

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


@pytest.mark.parametrize("client", ["process", "thread"])
def test_an_outage_is_said_once_and_shown_in_health_and_metrics(smollm2, tmp_path, caplog, client):
    caplog.set_level(logging.INFO)
    srv = ServerProcess(tmp_path).start()
    draft = DraftConfig(corpus_timeout_s=1.0, remote_client=client)
    drafter = Drafter(srv.target, draft, vocab_size=smollm2.model.config.vocab_size)
    try:
        with serve_api(smollm2, budget=4, drafter=drafter) as api:
            def complete() -> None:
                r = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True})
                assert r.status_code == 200, r.text

            complete()
            assert api.get("/healthz").json()["corpus"]["state"] == "reachable"
            srv.kill()
            steps = drafter.stats.fallback_steps
            deadline = time.monotonic() + 60
            while drafter.stats.fallback_steps < steps + 40:  # many steps in the outage
                assert time.monotonic() < deadline, drafter.stats
                complete()
            corpus = api.get("/healthz").json()["corpus"]
            assert corpus["state"] == "unreachable" and corpus["outages"] == 1 and corpus["unreachable_for_s"] > 0
            metrics = api.get("/metrics").text
            assert _metric(metrics, "ngram_verifier_corpus_unreachable") == 1.0
            assert _metric(metrics, "ngram_verifier_corpus_outages_total") == 1.0
            srv.start(grpc_port=srv.grpc_port)
            deadline = time.monotonic() + 60
            while api.get("/healthz").json()["corpus"]["state"] != "reachable":
                assert time.monotonic() < deadline, drafter.stats
                complete()
            corpus = api.get("/healthz").json()["corpus"]
            assert corpus["outages"] == 1 and corpus["outage_seconds"] > 0 and corpus["remote_drafting"]
            assert _metric(api.get("/metrics").text, "ngram_verifier_corpus_unreachable") == 0.0
    finally:
        drafter.close()
        if srv.alive():
            srv.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "corpus" in r.name]
    assert drafter.stats.remote_errors > 10  # many failed calls...
    assert len([m for m in said if "is unreachable" in m]) == 1, said  # ...one line when it starts
    assert len([m for m in said if "reachable again" in m]) == 1, said  # and one when it ends
    assert len(said) == 2, said


def test_the_client_process_reports_an_outage_once(tmp_path):
    srv = ServerProcess(tmp_path).start()
    proc = ClientProcess(ClientSettings(srv.target, timeout_s=1.0, breaker_cooldown_s=0.2))
    try:
        proc.calls([StartRequest("r", [1, 2, 3, 1, 2])])
        assert proc.draft(["r"], 4, 4).result(timeout=20) is not None
        srv.kill()
        end = time.monotonic() + 3.0  # 3 s of commits: the child flushes (and fails) every 0.1 s
        while time.monotonic() < end:
            proc.calls([Extend([("r", [3])])])
            proc.poll()
            time.sleep(0.02)
        notes = list(proc.errors)
        assert len(notes) == 1 and notes[0].code == "UNAVAILABLE", notes
        assert notes[0].text.startswith("CorpusUnavailable"), notes
        srv.start(grpc_port=srv.grpc_port)
        deadline = time.monotonic() + 30  # no draft asked: the child's probe finds the corpus back
        while REACHABLE_NOTE not in proc.errors:
            assert time.monotonic() < deadline, proc.errors
            proc.calls([Extend([("r", [3])])])
            proc.poll()
            time.sleep(0.05)
        assert proc.errors[1:] == [REACHABLE_NOTE], proc.errors
    finally:
        proc.close()
        if srv.alive():
            srv.stop()


def test_a_flapping_corpus_is_counted_not_logged_per_flap(caplog, monkeypatch):
    """Outages that begin right after the last one ended are counted; one that lasts is logged (late)."""
    import corpus_service.client.health as ch

    now = [1000.0]
    monkeypatch.setattr(ch.time, "monotonic", lambda: now[0])
    h = ch.CorpusHealth("127.0.0.1:1", "smollm2")
    down = Note("UNAVAILABLE", "CorpusUnavailable: circuit open for another 0.12s")
    with caplog.at_level(logging.WARNING, logger="verifier.corpus"):
        for _ in range(50):  # 50 flaps of 20 ms each, 20 ms apart
            h.failure(down)
            now[0] += 0.02
            h.success()
            now[0] += 0.02
        assert h.outages == 50 and h.recoveries == 50 and not h.unreachable
        assert len(caplog.records) == 2  # the first outage's start and end
        h.failure(down)  # a relapse that lasts: said once it has lasted CONFIRM_S
        now[0] += ch.CONFIRM_S
        h.failure(down)
        h.failure(down)
        assert len(caplog.records) == 3 and "49 brief outages" in caplog.records[-1].getMessage()
        h.success(asked_at=now[0] - 10)  # an answer asked before the outage began ends nothing
        assert h.unreachable
        h.success()
        assert len(caplog.records) == 4 and "reachable again" in caplog.records[-1].getMessage()
        h.failure(Note("UNAVAILABLE", "CorpusUnavailable: x"), asked_at=now[0] - 1)  # asked before it ended: that outage's
        assert not h.unreachable and h.outages == 51
        for i in range(20):  # a refused call (not an outage) is logged once per kind
            h.failure(Note("NOT_FOUND", f"CorpusNotFound: unknown request 'r{i}'"))
        assert len(caplog.records) == 5 and not h.unreachable
