#!/usr/bin/env bash
# The main job on embedded defaults: install into the checkout's virtual environment (.venv,
# scripts/install.sh), then the corpus + verifier demo on the CPU with the real SmolLM2-135M-Instruct
# (a `python -m corpus_service serve` subprocess on 127.0.0.1 and an in-process verifier): prints
# tokens/s with and without speculation, the acceptance (MAT) and whether the outputs are
# token-identical. Extra arguments go to the demo (e.g. --prompts 2 --max-tokens 32 --corpus local
# --budget 7); the trace replay is `python3 bench/acceptance.py`.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
# shellcheck disable=SC1091
. "${NGRAM_VENV:-.venv}/bin/activate"
python3 -m verifier demo "$@"
