"""The real SGLang for these tests: the pinned release in ``.engines/sglang`` (scripts/install_sglang.sh),
kept off the test process' own path. Each scenario runs in a child process with that folder on its
PYTHONPATH (``run_scenario``), loads the plugin through SGLang's own ``load_plugins()`` and prints
its result as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ENGINE_DIR = REPO / ".engines" / "sglang"
INSTALL_HINT = "bash scripts/install_sglang.sh (the pinned SGLang into .engines/sglang, docs/sglang.md)"


def require_engine() -> None:
    """Skips without the engine folder, with the command that installs it; fails under CI, which installs it."""
    if (ENGINE_DIR / "sglang" / "srt" / "plugins").is_dir():
        return
    message = f"SGLang is not installed in {ENGINE_DIR.relative_to(REPO)}: {INSTALL_HINT}"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(message)
    pytest.skip(message)


def engine_env(**extra: str) -> dict[str, str]:
    """The child's environment: the engine folder first on PYTHONPATH, no NGRAM_CORPUS_* of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NGRAM_CORPUS_", "SGLANG_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_DIR), str(REPO)])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_scenario(name: str, args: dict, env: dict[str, str], timeout: float = 120.0) -> dict:
    """``python -m tests.integrations.sglang.scenarios NAME ARGS``; its last stdout line, parsed."""
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.sglang.scenarios", name, json.dumps(args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"scenario {name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out
