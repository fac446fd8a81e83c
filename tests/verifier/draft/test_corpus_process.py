"""The remote corpus' client in a child process (verifier.draft.corpus_process): its frames, its answers
through a real server on 127.0.0.1, errors reported back, and a child that dies."""

import time

import pytest

from verifier.draft.calls import Extend, Finish, StartRequest
from verifier.draft.corpus_process import ClientProcess, ClientSettings
from verifier.draft.drafter import CorpusEndpoint, DraftConfig, Drafter


def test_answers_through_a_real_server(corpus_server):
    proc = ClientProcess(ClientSettings(corpus_server.target, timeout_s=5.0))
    try:
        proc.calls([StartRequest("p1", [1, 2, 3, 4, 1, 2, 3])])
        t = proc.draft(["p1"], 4, 4)
        batch = t.result(timeout=20)
        assert batch is not None and not t.error and batch.tree(0)[0][:1] == [4]
        # An unknown request: the call's error comes back as a note; the draft's as its error.
        proc.calls([Extend([("nobody", [1])])])
        t2 = proc.draft(["nobody"], 4, 4)
        assert t2.result(timeout=20) is None and "unknown request" in t2.error.text
        assert any("nobody" in e.text for e in proc.errors)
        proc.calls([Finish("p1")])
    finally:
        proc.close()
    assert proc._proc.returncode == 0


def _steps_until(drafter: Drafter, done, extend: list[int], timeout: float = 30.0) -> None:
    """Engine-like steps on request "r" (commit, draft, dispatch) until ``done()``; every step
    drafts (in process while the child is down) and none raises."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, drafter.stats
        drafter.extend("r", extend)
        assert len(drafter.draft(["r"], 4)) == 1
        drafter.dispatch()
        time.sleep(0.01)


def test_a_dead_child_is_replaced_and_the_live_requests_replayed(corpus_server):
    from corpus_service.client import CorpusClient

    with CorpusClient(corpus_server.target) as admin:
        before = admin.stats()
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0))
    try:
        drafter.start_request("r", [5, 6, 7, 5, 6], prompt_key="rollout/replayed", policy_version=3)
        drafter.start_request("r2", [1, 2, 3, 4], prompt_key="rollout/replayed", policy_version=3)
        drafter.start_request("gone", [1, 2, 3])
        drafter.draft(["r"], 4)
        drafter.dispatch()
        drafter._ahead[0].result(timeout=20)
        drafter.extend("r", [8])
        drafter.extend("r2", [4, 4])
        first = drafter.source.proc
        first._proc.kill()  # the child dies (a bug, the OOM killer)
        first._proc.wait()
        drafter.finish("gone")  # finished while no child runs: not replayed
        _steps_until(drafter, lambda: first.dead, [9])
        assert "client process stopped" in first.dead
        _steps_until(drafter, lambda: drafter.stats.client_restarts == 1, [9])
        assert "client process stopped" in drafter.stats.last_error and drafter.stats.remote_errors >= 1
        assert drafter.source.proc is not first and not drafter.source.proc.dead and first._proc.returncode is not None
        remote = drafter.stats.remote_steps
        _steps_until(drafter, lambda: drafter.stats.remote_steps >= remote + 3, [9])  # remote drafts again
        # The new child's session holds r: its prompt and every token committed before and after
        # the death (a context ending in 9, 9 drafts 9; the prompt alone would draft 7), not "gone".
        batch = drafter.source.proc.draft(["r"], 4, 4).result(timeout=20)
        assert batch is not None and batch.tree(0)[0][:1] == [9]
        t = drafter.source.proc.draft(["gone"], 4, 4)
        assert t.result(timeout=20) is None and "unknown request" in t.error.text
        drafter.finish("r")
        drafter.finish("r2")
        # The replayed starts kept their prompt key: both outputs join that one key's history on the
        # server (without it, each prompt would be a key of its own).
        deadline = time.monotonic() + 20
        with CorpusClient(corpus_server.target) as admin:
            while (after := admin.stats())["history_rollouts"] - before["history_rollouts"] < 2:
                assert time.monotonic() < deadline, after
                drafter.dispatch()
                time.sleep(0.05)
        assert after["history_keys"] - before["history_keys"] == 1
    finally:
        drafter.close()


def test_a_replacement_that_fails_to_start_is_retried_with_backoff(corpus_server, monkeypatch):
    """A child that dies young (a crash loop) or a replacement that does not start: the next try
    waits, twice as long each time; drafting goes on in process meanwhile."""
    import verifier.draft.sources as sources

    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0))
    src = drafter.source
    try:
        drafter.start_request("r", [5, 6, 7, 5, 6])
        first = drafter.source.proc
        first._proc.kill()
        first._proc.wait()
        real = sources.ClientProcess
        tries = []

        def failing(settings):
            tries.append(time.monotonic())
            raise ValueError("no client for you")

        monkeypatch.setattr(sources, "ClientProcess", failing)
        _steps_until(drafter, lambda: len(tries) >= 2 and src._restart is None, [9])
        # The child died young: the first try waits RESTART_DELAY_S, the next twice that.
        assert tries[1] - tries[0] >= 2 * sources.RESTART_DELAY_S
        assert src._restart_delay == 8 * sources.RESTART_DELAY_S
        assert drafter.stats.client_restarts == 0 and src.proc is first
        monkeypatch.setattr(sources, "ClientProcess", real)
        monkeypatch.setattr(sources, "MAX_RESTART_DELAY_S", 2.0)  # the test's patience
        src._restart_delay = min(src._restart_delay, 2.0)
        _steps_until(drafter, lambda: drafter.stats.client_restarts == 1, [9])
        drafter.finish("r")
    finally:
        drafter.close()


def test_sync_drafts_wait_for_the_child(corpus_server):
    draft = DraftConfig(corpus_timeout_s=5.0, remote_drafts="sync", draft_timeout_s=10.0)
    drafter = Drafter(corpus_server.target, draft)
    try:
        drafter.start_request("s", [3, 4, 5, 3, 4])
        out = drafter.draft(["s"], 4)
        assert out.tree(0)[0][:1] == [5] and drafter.stats.remote_steps == 1
        drafter.finish("s")
    finally:
        drafter.close()


def test_bad_client_settings_raise_value_error_at_construction(tmp_path):
    with pytest.raises(ValueError, match="tls ca: cannot read"):
        Drafter(CorpusEndpoint("127.0.0.1:1", tls=str(tmp_path / "missing-ca.pem")))


def test_a_child_writing_garbage_is_stopped_not_trusted(corpus_server):
    proc = ClientProcess(ClientSettings(corpus_server.target, timeout_s=5.0))
    try:
        t = proc.draft(["nobody"], 4, 4)
        proc._frames.feed = lambda data: (_ for _ in ()).throw(ValueError("a frame of 4294967295 bytes"))
        assert t.wait(20) and t.batch is None and "bad frame" in t.error.text
        assert "bad frame" in proc.dead
        proc._proc.wait(10)  # killed
    finally:
        proc.close()


@pytest.mark.parametrize("client", ["process", "thread"])
def test_a_corpus_refusing_deep_trees_caps_the_pipelined_depth(corpus_server, client):
    """The fixture's server serves at most 32 nodes: a deep ask of 2 x 20 = 40 is retried at the
    step's budget, and later asks go out at that budget."""
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
    try:
        drafter.start_request("c", [1, 2, 3, 1, 2, 3, 1, 2])
        drafter.draft(["c"], 20)
        drafter.dispatch()
        assert drafter._ahead[0].result(timeout=20) is not None
        drafter.extend("c", [3])
        drafter.draft(["c"], 20)  # takes the answer: the cap is noted
        assert drafter._ahead_cap == 20 and drafter.stats.remote_errors == 0
        drafter.finish("c")
    finally:
        drafter.close()


def test_closing_during_a_restart_closes_the_replacement(corpus_server, monkeypatch):
    """A replacement still starting when the drafter closes is closed by its thread, not leaked."""
    import threading

    import verifier.draft.sources as sources

    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0))
    src = drafter.source
    real, made, release = sources.ClientProcess, [], threading.Event()

    def slow(settings):
        release.wait(20)  # still starting when the drafter closes
        made.append(real(settings))
        return made[-1]

    try:
        drafter.start_request("r", [5, 6, 7, 5, 6])
        drafter.source.proc._proc.kill()
        drafter.source.proc._proc.wait()
        monkeypatch.setattr(sources, "ClientProcess", slow)
        _steps_until(drafter, lambda: src._restart is not None, [9])
        pending = src._restart
    finally:
        drafter.close()
    release.set()
    assert pending.done.wait(30) and pending.proc is None
    assert len(made) == 1 and made[0].dead == "closed" and made[0]._proc.returncode is not None


@pytest.mark.parametrize("client", ["process", "thread"])
def test_commits_reach_the_corpus_without_draft_requests(corpus_server, client):
    """An engine that never drafts (the policy decided plain decoding) still hands its commits to
    the child every step: the child sends what it holds within FLUSH_AFTER_S, so the shared corpus
    learns this verifier's outputs (here: another replica drafts them) though no draft request
    carries them."""
    from corpus_service.client import CorpusClient

    text = list(range(4101 + 20 * (client == "thread"), 4113 + 20 * (client == "thread")))
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
    try:
        drafter.start_request("quiet", text[:3])
        drafter.extend_many([("quiet", text[3:])])
        drafter.finish("quiet")
        drafter.dispatch()  # the calls go to the client; no draft follows
        time.sleep(0.15)
        drafter.dispatch()  # a later step (nothing new): the thread client's flush is paced by steps
        with CorpusClient(corpus_server.target) as other:
            deadline = time.monotonic() + 10
            k = 0
            while True:
                k += 1
                other.start_request(f"probe{client}{k}", text[:5])
                tree = other.draft([f"probe{client}{k}"], 4).tree(0)
                other.finish(f"probe{client}{k}")
                if tree[0][:1] == [text[5]]:
                    break
                assert time.monotonic() < deadline, "the commits never reached the corpus"
                time.sleep(0.05)
        assert drafter.stats.remote_errors == 0
    finally:
        drafter.close()


_INSTALLED_PARENT = """
import sys
import corpus_service, verifier
from verifier.draft.calls import StartRequest
from verifier.draft.corpus_process import ClientProcess, ClientSettings

proc = ClientProcess(ClientSettings(sys.argv[1], timeout_s=5.0))
proc.calls([StartRequest("p", [1, 2, 3, 1, 2])])
batch = proc.draft(["p"], 4, 4).result(timeout=30)
proc.close()
print(corpus_service.__file__, verifier.__file__, batch.tree(0)[0][:1])
"""


def test_a_plain_install_started_from_the_checkout_root(corpus_server, tmp_path):
    """After a plain (non-editable) ``pip install .``, a verifier started from the checkout's root:
    the child imports the installed packages as its parent did, not the checkout's
    ``corpus_service`` (no compiled ``_native`` there), whatever the current directory."""
    import shutil
    import site
    import subprocess
    import venv
    from pathlib import Path

    import corpus_service._native as native

    repo = Path(__file__).resolve().parents[3]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    purelib = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                           text=True).strip())
    import re

    # The packages the wheel holds, read from pyproject.toml (tomllib is not in Python 3.10).
    line = re.search(r"^wheel\.packages = \[(.*)\]$", (repo / "pyproject.toml").read_text(), re.M)
    packages = re.findall(r'"([^"]+)"', line.group(1))
    assert {"corpus_service", "verifier"} <= set(packages)
    for pkg in packages:  # what the wheel holds (CMakeLists' install: _native in the package)
        shutil.copytree(repo / pkg, purelib / pkg, ignore=shutil.ignore_patterns("__pycache__", "csrc", "*.so"))
    shutil.copy(native.__file__, purelib / "corpus_service")
    # The dependencies from this environment: a .pth line adds a directory without running its .pth
    # files (this checkout's editable-install finder is not in the new environment).
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    assert not list((repo / "corpus_service").glob("_native*"))  # the checkout itself cannot serve the child
    script = tmp_path / "parent.py"  # like the console script: its directory, not the cwd, leads the parent's path
    script.write_text(_INSTALLED_PARENT)
    out = subprocess.run([py, str(script), corpus_server.target], cwd=repo, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(str(purelib / "corpus_service")) and out.stdout.strip().endswith("[3]"), out.stdout


def test_a_refused_depth_is_known_by_its_code_not_its_text():
    """Only OUT_OF_RANGE (the corpus' --max-budget) or the engine's BudgetTooLargeError asks again
    at a step's budget; another refusal that happens to say "budget" is an error."""
    from corpus_service.client import CorpusOutOfRange
    from corpus_service.exceptions import BudgetTooLargeError
    from corpus_service.protocol.status import CorpusInvalidArgument
    from verifier.draft.corpus_process import _refused_depth

    assert _refused_depth(CorpusOutOfRange("too deep"), 8, 4)
    assert _refused_depth(BudgetTooLargeError("too deep"), 8, 4)
    assert not _refused_depth(CorpusOutOfRange("too deep"), 4, 4)  # nothing smaller to ask for
    assert not _refused_depth(CorpusInvalidArgument("draft.budget: expected an int >= 1"), 8, 4)
    assert not _refused_depth(ValueError("budget"), 8, 4)
