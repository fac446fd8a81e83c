#!/usr/bin/env bash
# Installs the pinned SGLang release that the SGLang plugin is built for (docs/sglang.md) into
# .engines/sglang (git-ignored), beside the project's venv and never into it: the venv keeps its own
# torch (the CPU build), SGLang's own pin (torch 2.14.1) is not installed, and nothing of SGLang leaks
# into the project's environment. Only the packages SGLang's plugin loader and its C++ n-gram corpus
# need to import (pip --no-deps); the rest of SGLang (sgl-kernel, flashinfer...) is a GPU host's.
# Use it with PYTHONPATH=.engines/sglang (tests/integrations/sglang run their SGLang code that way).
# Idempotent: a folder that already holds these versions is kept. Then SGLang's C++ corpus is
# JIT-compiled once (~30 s on 2 cores) into SGLang's JIT cache (SGLANG_JIT_CACHE_DIR, default
# ~/.cache/sglang/jit), which later runs on this machine reuse.
# Env: NGRAM_VENV (default .venv), SGLANG_ENGINE_DIR (default .engines/sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NGRAM_VENV:-.venv}"
DEST="${SGLANG_ENGINE_DIR:-.engines/sglang}"
PINS=(sglang==0.5.23 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 triton==3.9.0 pillow==13.0.0 msgspec==0.23.0
      pyzmq==27.3.0 ipython==9.19.1 traitlets==5.16.1 apache-tvm-ffi==0.1.15.post2)
say() { echo "install_sglang: $*" >&2; }

[ -x "$VENV/bin/python3" ] || { say "no virtual environment at $VENV: run scripts/install.sh first"; exit 1; }
PY="$VENV/bin/python3"
stamp="$DEST/.pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${PINS[*]}" ]; then
  say "$DEST already holds ${PINS[0]}"
else
  rm -rf "$DEST"
  mkdir -p "$DEST"
  say "installing ${PINS[*]} into $DEST"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DEST" "${PINS[@]}" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  [ -d "$DEST/sglang/srt/plugins" ] || { say "pip did not install SGLang into $DEST"; exit 1; }
  echo "${PINS[*]}" >"$stamp"
fi
# The import chain and SGLang's own corpus (the JIT build, cached for the tests and benchmarks).
PYTHONPATH="$DEST" "$PY" - <<'PY'
import time
t = time.perf_counter()
import sglang.srt.plugins  # noqa: F401
from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
NgramCorpus(draft_token_num=16)
print(f"install_sglang: SGLang's plugin loader and NgramCorpus ready ({time.perf_counter() - t:.1f} s)")
PY
