"""Where a server keeps its data: $XDG_DATA_HOME/ngram-corpus (~/.local/share/ngram-corpus) unless
told otherwise, printed at start; --data-dir '' keeps nothing and says so once; two servers never
share one data directory (the second is refused, naming the first)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from corpus_service.admin.persistence import LOCK_NAME, DataDir, DataDirInUse
from corpus_service.client import CorpusClient
from corpus_service.server.config import ServiceConfig, default_data_dir
from tests.corpus_service.service_fixtures import ServerProcess

NO_DATA_DIR_WARNING = "no data directory (--data-dir ''): nothing persists"


class DefaultDirServer(ServerProcess):
    """A service-test server that names no --data-dir (its ports file and log stay in ``workdir``)."""

    def command(self, grpc_port: int = 0, admin_port: int | None = None) -> list[str]:
        cmd = super().command(grpc_port, admin_port)
        i = cmd.index("--data-dir")
        return cmd[:i] + cmd[i + 2:]


def test_default_data_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == str(tmp_path / "xdg" / "ngram-corpus")
    assert ServiceConfig().data_dir == str(tmp_path / "xdg" / "ngram-corpus") and ServiceConfig().persistent
    for unset in ("", "relative/dir"):  # the XDG specification: a relative value is ignored
        monkeypatch.setenv("XDG_DATA_HOME", unset)
        assert default_data_dir() == str(tmp_path / "home" / ".local" / "share" / "ngram-corpus")
    assert not ServiceConfig(data_dir="").persistent
    assert ServiceConfig(data_dir=str(tmp_path / "d")).data_dir == str(tmp_path / "d")
    with pytest.raises(ValueError, match="data_dir: expected a directory path or ''"):
        ServiceConfig(data_dir=3)


def test_the_lock_refuses_a_second_holder_and_is_released(tmp_path):
    first, second = DataDir(tmp_path), DataDir(tmp_path)
    first.lock()
    with pytest.raises(DataDirInUse, match=rf"in use by another ngram-corpus server \(pid {os.getpid()}\)"):
        second.lock()
    first.unlock()
    second.lock()  # released: the next one gets it
    second.unlock()


def test_default_location_is_used_printed_and_kept(tmp_path):
    xdg = tmp_path / "xdg"
    data = xdg / "ngram-corpus"
    srv = DefaultDirServer(tmp_path / "work", env={"XDG_DATA_HOME": str(xdg)}).start()
    try:
        assert f"data directory: {data} " in srv.log()
        assert (data / LOCK_NAME).read_text().strip() == str(srv.proc.pid)
        with CorpusClient(srv.target) as c:
            c.start_request("r", [1, 2])
            c.extend("r", list(range(100, 140)))
            c.finish("r")
            c.synchronize()
        metrics = httpx.get(f"{srv.admin_url}/metrics", timeout=10).text
        assert re.search(r"^ngram_corpus_persistent 1\.0$", metrics, re.M), metrics[-2000:]

        # A second server on the same directory (NGRAM_CORPUS_DATA_DIR this time) is refused at once,
        # naming the holder; the first keeps serving.
        second = DefaultDirServer(tmp_path / "work2", env={"NGRAM_CORPUS_DATA_DIR": str(data)})
        with pytest.raises(RuntimeError, match="exited with 1") as refused:
            second.start(timeout=60)
        assert f"data directory {data} is in use by another ngram-corpus server (pid {srv.proc.pid})" \
            in str(refused.value)
        assert "Traceback" not in str(refused.value)
        assert srv.alive() and httpx.get(f"{srv.admin_url}/readyz", timeout=10).status_code == 200
    finally:
        assert srv.stop() == 0
    assert (data / "snapshots" / "default.ngc").is_file()  # the shutdown snapshot went there


def test_no_data_dir_is_explicit_warns_once_and_keeps_nothing(tmp_path):
    xdg = tmp_path / "xdg"
    srv = ServerProcess(tmp_path / "work", env={"XDG_DATA_HOME": str(xdg)})
    srv.persist = False  # CorpusServer's --data-dir ''
    srv.start()
    try:
        with CorpusClient(srv.target) as c:
            c.start_request("r", [1, 2])
            c.extend("r", list(range(100, 140)))
            c.finish("r")
        metrics = httpx.get(f"{srv.admin_url}/metrics", timeout=10).text
        assert re.search(r"^ngram_corpus_persistent 0\.0$", metrics, re.M), metrics[-2000:]
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert log.count(NO_DATA_DIR_WARNING) == 1, log
    assert not xdg.exists() and not list(Path(tmp_path / "work").glob("snapshots"))


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    # A replica forks its snapshot writers: were the child to keep the lock's descriptor, a server
    # killed while one runs would leave its directory locked until the child ends.
    held = DataDir(tmp_path)
    held.lock()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent lets go; the child must not hold the lock now
        os.close(w)
        os.read(r, 1)
        try:
            DataDir(tmp_path).lock()
            os._exit(0)
        except DataDirInUse:
            os._exit(3)
    os.close(r)
    held.unlock()
    os.write(w, b"x")
    os.close(w)
    assert os.waitpid(pid, 0)[1] == 0
