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
