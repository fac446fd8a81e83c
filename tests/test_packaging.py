"""What a plain `pip install ngram-corpus` (no extras) gives: everything `ngram-corpus serve` and its
admin commands import is among the base dependencies (or theirs), and `ngram-verifier` without its
extra answers one line naming it instead of a traceback."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import tomllib

from tests.conftest import REPO

# What `ngram-corpus serve` (with --log nats://..., replication) and the admin commands import.
SERVE_MODULES = ["corpus_service.cli", "corpus_service.server.main", "corpus_service.admin.client",
                 "corpus_service.replication.replica", "corpus_service.replication.blobstore", "tqdm"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: list[str]) -> set[str]:
    """The distributions that installing ``names`` brings, by their installed metadata (extras' and
    markers' requirements left out: pip installs those only on request)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for req in md.requires(n) or []:
            if ";" not in req:
                todo.append(_name(req))
    return seen


def test_serve_imports_only_base_dependencies():
    base = [_name(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    allowed = _closure(base) | {"ngram-corpus"}
    # A fresh interpreter that can import only what a base install has: every other installed
    # top-level module (the verifier's extra, the test and dev tools) is blocked, so an optional
    # import inside a library fails as it would there and a required one fails the test.
    blocked = sorted(m for m, ds in md.packages_distributions().items() if not {_name(d) for d in ds} & allowed)
    assert "torch" in blocked  # the verifier's extra is not in a base install
    code = ("import sys, importlib\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            f"for m in {SERVE_MODULES!r}: importlib.import_module(m)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, f"serving imports something beyond the base dependencies:\n{out.stderr[-3000:]}"


def test_verifier_without_its_extra_names_it():
    code = ("import sys\nsys.modules['torch'] = None\n"
            "from verifier.cli import main\nsys.exit(main(['serve', '--help']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert out.stderr.strip().splitlines() == [
        'ngram-verifier: error: torch is not installed; the verifier needs the extra: pip install "ngram-corpus[verifier]"']
