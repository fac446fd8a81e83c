#!/usr/bin/env bash
# The main job on embedded defaults. Today: install, then replay the shipped real-model traces
# through the corpus engine and print acceptance (MAT) against prompt lookup and the oracle.
# Extra arguments go to bench/acceptance.py (e.g. --budget 15 --mode prob).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
python3 bench/acceptance.py "$@"
