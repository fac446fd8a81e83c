"""Shared test configuration. GPU tests (``-m gpu``) are skipped unless CUDA is available."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    env = os.environ.get("NGRAM_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = shared_data_dir()
    if not d.exists():
        pytest.skip(f"shared data folder not found at {d} (set NGRAM_SHARED_DATA)")
    return d
