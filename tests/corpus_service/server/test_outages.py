"""A dependency outage on the server side is logged once when it starts and once when it ends, and
counted: the data directory failing under periodic snapshots, the commit log's broker going away.
Real server processes, a real nats-server."""

from __future__ import annotations

import shutil
import time

import pytest

from corpus_service.client import CorpusClient
from tests.corpus_service.replication_fixtures import NATS_SERVER, NatsServer, replica, wait_for
from tests.corpus_service.server.test_caller_limits import metrics
from tests.corpus_service.service_fixtures import ServerProcess


def outages(srv: ServerProcess, dependency: str) -> tuple[float, float]:
    """(episodes counted, down now) for one dependency."""
    m = metrics(srv)
    key = (("dependency", dependency),)
    return m.get(("ngram_corpus_dependency_outages_total", key), 0.0), m.get(("ngram_corpus_dependency_down", key), 0.0)


def log_lines(srv: ServerProcess, start: int, *words: str) -> list[str]:
    text = srv.log_path.read_text(errors="replace")[start:]
    return [line for line in text.splitlines() if all(w in line for w in words)]


def test_data_directory_outage_is_logged_once_each_way_and_counted(tmp_path):
    srv = ServerProcess(tmp_path, "--namespace", "default", "--snapshot-interval-s", "0.1").start()
    try:
        with CorpusClient(srv.target, timeout=10) as c:
            snaps = tmp_path / "snapshots"
            shutil.rmtree(snaps)
            snaps.write_text("not a directory: every snapshot fails")
            for i in range(15):  # 1.5 s of changes: about 15 failed periodic snapshots
                c.start_request(f"r{i}", list(range(64)))
                c.finish(f"r{i}")
                c.flush()
                time.sleep(0.1)
            assert outages(srv, "data directory") == (1, 1)
            snaps.unlink()
            snaps.mkdir()
            wait_for(lambda: outages(srv, "data directory") == (1, 0), 10, "the data directory's recovery")
        log = srv.log_path.read_text(errors="replace")
        assert log.count("Traceback") <= 1, log  # the first failure's, with its reason
        assert len(log_lines(srv, 0, "WARNING", "data directory unavailable")) == 1, log
        assert len(log_lines(srv, 0, "ERROR")) == 0, log
        assert len(log_lines(srv, 0, "data directory available again")) == 1, log
    finally:
        srv.kill()


@pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (.ci/run installs it)")
def test_commit_log_outage_is_logged_once_each_way_and_counted(tmp_path):
    nats = NatsServer(tmp_path / "nats").start()
    srv = replica(tmp_path / "r1", nats, "r1", tmp_path / "blobs").start()
    try:
        wait_for(lambda: "connected to the commit log" in srv.log(), 30, "the replica to connect")
        start = len(srv.log_path.read_text(errors="replace"))
        nats.kill()
        with CorpusClient(srv.target, timeout=10) as c:  # commits go on (buffered) during the outage
            for i in range(20):
                c.start_request(f"r{i}", list(range(64)))
                c.finish(f"r{i}")
                c.flush()
                time.sleep(0.1)
        assert outages(srv, "commit log") == (1, 1)
        nats.start()
        wait_for(lambda: outages(srv, "commit log") == (1, 0), 30, "the commit log's recovery")
        assert len(log_lines(srv, start, "commit log unavailable")) == 1, srv.log()
        assert len(log_lines(srv, start, "commit log available again")) == 1, srv.log()
    finally:
        srv.kill()
        nats.kill()
