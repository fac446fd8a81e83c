"""vLLM 0.33.0 for the plugin's tests: installed beside the venv by ``scripts/install_vllm.sh``
(``.engines/vllm``, ``.engines/arctic``) and run in processes of its own (``scenarios.py``), so
vLLM and its modules never enter the test process. Without the folders the tests skip, saying how
to install them; under CI (``.ci/run`` installs them, as it installs SGLang) or with
``NGRAM_REQUIRE_VLLM=1`` (the install ran) a missing folder is a failure instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ENGINE_DIRS = (REPO / ".engines" / "vllm", REPO / ".engines" / "arctic")
INSTALL = "bash scripts/install_vllm.sh"


def require_vllm() -> None:
    missing = [str(d.relative_to(REPO)) for d in ENGINE_DIRS if not (d / ".ngram-corpus-pins").exists()]
    if not missing:
        return
    why = f"vLLM 0.33.0 is not installed ({', '.join(missing)} missing): run `{INSTALL}`"
    if os.environ.get("NGRAM_REQUIRE_VLLM") == "1":
        pytest.fail(why + " (NGRAM_REQUIRE_VLLM=1)")
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(why + " (CI installs it: .ci/run)")
    pytest.skip(why)


def run_scenario(name: str, workdir: Path, timeout: float = 600) -> dict:
    """Runs ``scenarios.py NAME`` with vLLM on the path; its ``RESULT`` line as a dict."""
    require_vllm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, ENGINE_DIRS)]),
           "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("NGRAM_CORPUS_TARGET", None)
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.scenarios", name, str(workdir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"scenario {name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])
