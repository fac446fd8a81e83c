"""The prompt history replicated like the learned corpus, on a real nats-server (JetStream) on
127.0.0.1 with real ``python -m corpus_service serve --nats-url ...`` replicas: a keyed request that
finishes on one replica drafts for its key's next sample on another, policy announcements travel
through the log (and are refused there when older), every replica holds the same history (the
digest covers it), and a restarted or late replica gets it back from the snapshot and the log."""

from __future__ import annotations

import pytest

from corpus_service.client import CorpusClient
from corpus_service.protocol.status import CorpusFailedPrecondition
from tests.corpus_service.replication_fixtures import (NATS_SERVER, TOKEN, NatsServer, converged, replica, status,
                                                       wait_for, wait_ready)

pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (.ci/run installs it: "
                                                            "apt-get install -y nats-server)")

PROMPT = [7, 8, 9, 10, 11, 12]
OUTPUT = [400, 401, 402, 403, 404, 405, 406]
# The learned corpus weighs 0 and min_prob leaves its nodes out: drafts of a rollout come from the
# prompt history alone.
NAMESPACE = "hist:learned_weight=0,min_prob=0.01,history_max_age=2,flush_tokens=16"


@pytest.fixture()
def cluster(tmp_path):
    nats = NatsServer(tmp_path / "nats").start()
    started = []

    def start(name: str, *extra: str):
        srv = replica(tmp_path / name, nats, name, tmp_path / "blobs", "--namespace", NAMESPACE, *extra).start()
        started.append(srv)
        return srv

    yield nats, start
    for srv in started:
        if srv.alive():
            srv.kill()
    nats.kill()


def rollout(target: str, rid: str, key: str, version: int | None = None, output=OUTPUT) -> None:
    with CorpusClient(target, "hist", timeout=10) as c:
        c.start_request(rid, PROMPT, prompt_key=key, policy_version=version)
        c.draft([rid], 4)
        c.extend(rid, output)
        c.finish(rid)
        c.flush()


def history_draft(target: str, key: str, version: int | None = None) -> list[int]:
    with CorpusClient(target, "hist", timeout=10) as c:
        c.start_request("probe", PROMPT, prompt_key=key, policy_version=version)
        tokens, _, _ = c.draft(["probe"], 8).tree(0)
        c.finish("probe", rollout=False)
        return tokens


def hist_stats(target: str) -> dict:
    with CorpusClient(target, "hist", timeout=10) as c:
        return c.stats()


def test_rollouts_and_announcements_reach_every_replica(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    with CorpusClient(a.target, "hist", timeout=10, token=TOKEN) as c:
        assert c.announce_policy_version(1) == 1  # through the log, applied here before the answer
    rollout(a.target, "s0", "task/1")  # the namespace's version: 1
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"]
    for srv in (a, b):
        s = hist_stats(srv.target)
        assert (s["policy_version"], s["history_rollouts"], s["history_keys"]) == (1, 1, 1)
    # The next sample of the prompt, on the other replica, drafts the first one's output.
    assert history_draft(b.target, "task/1")[:len(OUTPUT)] == OUTPUT
    assert history_draft(b.target, "task/2") == []
    # An older version is refused on any replica; a newer one drops what is max_age (2) old everywhere.
    with CorpusClient(b.target, "hist", timeout=10, token=TOKEN) as c:
        with pytest.raises(CorpusFailedPrecondition, match="older"):
            c.announce_policy_version(0)
        assert c.announce_policy_version(3) == 3
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"]
    for srv in (a, b):
        s = hist_stats(srv.target)
        assert (s["policy_version"], s["history_rollouts"]) == (3, 0)


def test_abandoned_requests_publish_no_rollout(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    with CorpusClient(a.target, "hist", timeout=10) as c:
        c.start_request("x", PROMPT, prompt_key="k")
        c.extend("x", OUTPUT)
        c.finish("x", rollout=False)
        c.flush()
    rollout(a.target, "y", "k", output=OUTPUT[:3])
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"]
    assert hist_stats(b.target)["history_rollouts"] == 1
    assert history_draft(b.target, "k")[:3] == OUTPUT[:3]


def test_restarted_and_late_replicas_get_the_history_back(cluster):
    nats, start = cluster
    a = start("a", "--snapshot-interval-s", "0.2")
    b = start("b", "--snapshot-interval-s", "0")
    wait_ready(a), wait_ready(b)
    rollout(a.target, "s0", "before/snapshot", version=0)
    converged([a, b])
    wait_for(lambda: status(a)["snapshot_seq"] > 0, 30, "a snapshot")
    a.kill()  # kill -9: no shutdown snapshot
    rollout(b.target, "s1", "after/snapshot", version=0)  # only in the log
    a.start()
    wait_ready(a)
    assert "loaded snapshot at seq" in a.log()
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"]
    late = start("late", "--snapshot-interval-s", "0")
    wait_ready(late)
    s = converged([a, b, late])
    assert len({x["digest"] for x in s}) == 1
    for srv in (a, late):
        assert hist_stats(srv.target)["history_rollouts"] == 2
        assert history_draft(srv.target, "before/snapshot")[:len(OUTPUT)] == OUTPUT
        assert history_draft(srv.target, "after/snapshot")[:len(OUTPUT)] == OUTPUT
