"""Shared test configuration. GPU tests (``-m gpu``) are skipped unless CUDA is available."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis profiles (docs/testing.md). "ci", chosen when CI is set: the same examples on every run
# (derandomize: drawn from a seed fixed by each test), a fixed count, nothing written to
# .hypothesis/, so a submission is never red for a case the previous one did not meet. "dev" (the
# default): random examples, failures kept in .hypothesis/ and replayed first. "long": thousands of
# random examples, run by hand (a failure prints its example: add it as an @example once fixed).
# A test's own @settings win over its profile's: tests that should follow the profile set no
# max_examples.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, max_examples=100, database=None, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=100, **_COMMON)
settings.register_profile("long", max_examples=5000, database=None, print_blob=True, **_COMMON)
_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _CI else "dev"))

REPO = Path(__file__).resolve().parent.parent
REPO_TRACES = REPO / "bench" / "data" / "traces"
# The shared folder's greedy traces and the repository's sampled traces of the same prompts: the same
# ids and prompt_ids in the same order, each prompt's samples on consecutive lines, sample 0 first
# (tests/test_trace_fallback.py checks it where the shared folder is present).
SAMPLED_TWINS = {"humaneval164_greedy.jsonl": "humaneval164_t07x4.jsonl",
                 "specbench_dev120_greedy.jsonl": "specbench_dev120_t07x4.jsonl"}

# A server started without --data-dir keeps its data in $XDG_DATA_HOME/ngram-corpus. Servers that tests
# start use a temporary directory or --data-dir '' (nothing kept); should one miss both, it writes into
# a folder of the test run's own, never the user's home, and the run fails (pytest_sessionfinish).
XDG_DATA_HOME = Path(tempfile.mkdtemp(prefix="ngram-tests-xdg-"))
os.environ["XDG_DATA_HOME"] = str(XDG_DATA_HOME)


def pytest_sessionfinish(session, exitstatus):
    used = XDG_DATA_HOME / "ngram-corpus"
    if used.exists():
        print(f"\nerror: a test started a corpus server on the default data directory ({used}): give it a "
              "temporary --data-dir, --data-dir '' or NGRAM_CORPUS_DATA_DIR")
        session.exitstatus = 1
    shutil.rmtree(XDG_DATA_HOME, ignore_errors=True)


def shared_data_dir() -> Path:
    env = os.environ.get("NGRAM_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = shared_data_dir()
    if not d.exists():
        pytest.skip(f"shared data folder not found at {d} (set NGRAM_SHARED_DATA)")
    return d


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_trace(name: str) -> list[dict]:
    """The rows of one of the shared folder's greedy traces (``name``), or, on a fresh clone without
    it, sample 0 of each prompt of the repository's sampled trace of the same prompts: the same
    prompts, with real outputs of the same model sampled at temperature 0.7 (each row's
    ``temperature`` says which). For tests that need the prompts or model-made text, not the greedy
    outputs."""
    shared = shared_data_dir() / "traces" / name
    if shared.is_file():
        return read_jsonl(shared)
    if name not in SAMPLED_TWINS:
        raise FileNotFoundError(f"{shared}: not found, and the repository has no trace of the same prompts "
                                f"(it has {sorted(SAMPLED_TWINS)})")
    return [r for r in read_jsonl(REPO_TRACES / SAMPLED_TWINS[name]) if r["sample"] == 0]


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory):
    """A trace file for benchmark smoke tests: ``trace_file(name)`` is the shared folder's greedy
    trace ``name``, or on a fresh clone a file of ``prompt_trace(name)``'s rows (the same prompts,
    sample 0 of the repository's sampled trace; the smoke tests replay outputs, whichever they are)."""
    def get(name: str) -> Path:
        shared = shared_data_dir() / "traces" / name
        if shared.is_file():
            return shared
        path = tmp_path_factory.mktemp("traces") / name
        path.write_text("".join(json.dumps(r) + "\n" for r in prompt_trace(name)))
        return path
    return get

