"""The drafting sources (verifier.draft.sources) behind one interface: the in-process corpus, the
client in a child process and the client on a thread take the same operations and answer a draft
with a Pending, each against a real corpus (in process, or a server on 127.0.0.1)."""

import pytest

from corpus_service import NgramCorpus
from corpus_service.client import CorpusClient
from verifier.draft.config import CorpusEndpoint, DraftConfig
from verifier.draft.sources import ChildProcessSource, InProcessSource, ThreadSource, remote_source

TEXT = [21, 22, 23, 24, 25, 21, 22, 23]


def _exercise(src, rid: str, remote: bool = False) -> None:
    src.start(rid, TEXT[:5])
    src.extend([(rid, TEXT[5:])])
    if remote:
        assert len(src.held) == 2  # held until sent: by send(), or first thing by a draft
    pending = src.draft([rid], 8, 4)
    batch = pending.result(timeout=20)
    assert pending.done() and pending.error is None and not pending.capped
    tokens, parents = batch.tree(0)[:2]
    assert len(batch) == 1 and tokens[:1] == [24] and parents[0] == -1  # 21 22 23 -> 24, learned from the prompt
    src.finish(rid)
    if not remote:  # in process: a caller's mistake raises at once, as NgramCorpus does
        from corpus_service.exceptions import UnknownRequestError

        with pytest.raises(UnknownRequestError):
            src.draft([rid], 4, 4)
        return
    asked = src.draft([rid], 4, 4)  # finished: the corpus no longer knows it
    assert asked.wait(20)  # remote: the refusal is the draft's answer (the client knows it finished)
    assert asked.result(timeout=1) is None and "unknown request" in asked.error.text, asked.error
    assert asked.error.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # a refusal, not an outage


def test_in_process_source():
    src = InProcessSource(NgramCorpus())
    _exercise(src, "p")
    stats = src.stats()  # the corpus' own statistics
    assert stats["drafts"] == 1 and stats["live_requests"] == 0


@pytest.mark.parametrize("client", ["process", "thread"])
def test_remote_sources(corpus_server, client):
    with CorpusClient(corpus_server.target) as c:
        c.reset()
    src = remote_source(CorpusEndpoint(corpus_server.target), DraftConfig(remote_client=client, corpus_timeout_s=5.0))
    assert isinstance(src, ChildProcessSource if client == "process" else ThreadSource)
    try:
        _exercise(src, f"r-{client}", remote=True)
        assert src.take_notes() == []  # the finished request's draft failed as its own answer, not as a note
        assert not src.dead
        if client == "process":
            assert src.stats()["client_restarts"] == 0 and src.stats()["client_pid"] > 0
    finally:
        src.close()


def test_an_endpoint_is_validated():
    with pytest.raises(ValueError, match="HOST:PORT"):
        CorpusEndpoint("nowhere")
    with pytest.raises(ValueError, match="namespace"):
        CorpusEndpoint("127.0.0.1:1", namespace="")
    assert "secret" not in repr(CorpusEndpoint("127.0.0.1:1", token="secret"))
