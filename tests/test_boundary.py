"""The packages' boundaries, read from their import statements (function-local ones included):
the verifier imports only the corpus' public API (``corpus_service`` and ``corpus_service.client``),
the corpus never imports the verifier, ``ngram_common`` imports neither, and no module imports
itself back through others (no import circles)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("corpus_service", "verifier", "ngram_common")
# What the verifier may import of the corpus: its top-level API and its client package.
CORPUS_PUBLIC = {"corpus_service", "corpus_service.client"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if "_proto" not in path.parts:  # generated code
                out[_module_name(path)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement in the file; ``from X import Y`` names
    module X.Y where Y is a module, else X."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                # A native module is no .py file: a private name (_native) is a module all the same.
                out.append((sub if sub in known or a.name.startswith("_") and a.name != "__future__" else mod,
                            node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_the_verifier_imports_only_the_corpus_public_api():
    bad = [f"{m}:{line} imports {t}" for m, imps in _graph().items() if m.split(".")[0] == "verifier"
           for t, line in imps if t.split(".")[0] == "corpus_service" and t not in CORPUS_PUBLIC]
    assert not bad, "the verifier reaches into the corpus' private modules:\n" + "\n".join(bad)


def test_the_corpus_never_imports_the_verifier_and_the_common_package_neither():
    bad = [f"{m}:{line} imports {t}" for m, imps in _graph().items() for t, line in imps
           if (m.startswith("corpus_service") and t.startswith("verifier"))
           or (m.startswith("ngram_common") and t.split(".")[0] in ("corpus_service", "verifier"))]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    graph = _graph()
    edges = {m: sorted({t for t, _ in imps if t in graph and t != m}) for m, imps in graph.items()}
    # Tarjan's strongly connected components: a component of two or more modules is a circle.
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_private_import(tmp_path):
    """The rule above can fail: a private import written into a module is found."""
    known = {"verifier.x": tmp_path / "x.py"}
    known["verifier.x"].write_text("from corpus_service import _native\nfrom corpus_service.engine import corpus\n")
    found = [t for t, _ in _imports("verifier.x", known["verifier.x"], known)]
    assert found == ["corpus_service._native", "corpus_service.engine"]
    assert not set(found) & CORPUS_PUBLIC
