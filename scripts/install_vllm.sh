#!/usr/bin/env bash
# vLLM 0.33.0 and ArcticInference's SuffixDecoding for the vLLM plugin's tests and benchmark
# (docs/vllm.md), each in its own folder beside the checkout's venv, never inside it: the venv keeps
# its own torch (CPU) and packages, and vLLM's code runs with PYTHONPATH=.engines/vllm:.engines/arctic.
# --no-deps: vLLM's own requirements would pull a CUDA torch; the few modules its import chain
# needs on a CPU are listed and pinned here. Idempotent: a stamp of the pins skips a second run.
#
#   bash scripts/install_vllm.sh            # .engines/vllm and .engines/arctic
#   NGRAM_VENV=/path/to/venv bash scripts/install_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NGRAM_VENV:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_vllm: no virtual environment at $VENV (run scripts/install.sh first)" >&2; exit 1; }

VLLM_PINS=(vllm==0.33.0 regex==2026.12.2 cbor2==6.3.0 transformers==5.25.0 openai-harmony==0.0.8
  cachetools==8.0.3 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 xgrammar==0.2.9
  partial-json-parser==0.2.1.1.post7 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 triton==3.9.0
  pillow==13.0.0 msgspec==0.23.0 pyzmq==27.3.0 ipython==9.19.1 apache-tvm-ffi==0.1.15.post2 einops==0.8.2)
# vLLM's suffix method requires it (vllm/config/speculative.py names this version); an sdist, built here.
ARCTIC_PINS=(arctic-inference==0.1.1)

install() {  # folder, pins...
  local dir="$1"; shift
  local stamp="$dir/.ngram-corpus-pins"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$*" ]; then
    echo "install_vllm: $dir is up to date"
    return
  fi
  rm -rf "$dir"
  "$PY" -m pip install -q --no-deps --target "$dir" "$@"
  echo "$*" > "$stamp"
  echo "install_vllm: installed $* into $dir"
}

install .engines/vllm "${VLLM_PINS[@]}"
install .engines/arctic "${ARCTIC_PINS[@]}"
PYTHONPATH=.engines/vllm:.engines/arctic "$PY" -c "
import vllm, vllm.plugins
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
from arctic_inference.suffix_decoding import SuffixDecodingCache
assert vllm.__version__ == '0.33.0', vllm.__version__
print('install_vllm: vLLM', vllm.__version__, 'and arctic_inference import')" 2>&1 | grep '^install_vllm' \
  || { echo "install_vllm: vLLM does not import from .engines/vllm" >&2; exit 1; }
