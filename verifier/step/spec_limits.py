"""Limits a structured-output spec must meet before it is compiled (``structured_spec.GrammarSpec``).

llguidance compiles grammars lazily: a schema or regex it cannot serve is accepted by the matcher's
constructor and only fails at the first mask (or tokens later), where the request would end with
a parser dump or, for a grammar with no finite output such as ``{"$ref": "#"}``, with empty text and
``finish_reason: "stop"``. What can be checked on the spec itself is checked here, so the API
answers 400 naming the problem; ``grammar.GrammarCompiler.matcher`` then computes the first mask
at request time for what only llguidance can tell.

- JSON schemas: at most ``MAX_SCHEMA_DEPTH`` levels of nesting, local ``$ref``s only where they
  resolve, and no recursion through ``$ref`` (a schema that refers to itself or to one of its
  ancestors): llguidance's JSON compiler expands references, and recursive ones make either a
  language with no finite document or one the lexer cannot bound.
- Regexes (``regex``, the ``pattern`` of a schema string, and an ``ebnf`` grammar's repetitions, Lark's
  ``~ n..m`` included, are llguidance's lexer): each
  repetition count ``{m,n}`` at most ``MAX_REPEAT``, and counts of nested groups multiplied at most
  ``MAX_REPEAT_PRODUCT`` (``a{1000000}`` costs ~0.35 s of lexer building per request on the CPU and
  grows linearly; ``a{10000}`` ~13 ms).
"""

from __future__ import annotations

import re

MAX_SCHEMA_DEPTH = 64  # nested objects/arrays of a JSON schema
MAX_REF_TARGETS = 1024  # distinct $ref targets of one schema
MAX_REPEAT = 10_000  # one {m,n} count
MAX_REPEAT_PRODUCT = 100_000  # counts of nested repetitions multiplied

_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # Lark's "x ~ n" / "x ~ n..m"


def check_schema(schema: object, what: str = "json_schema") -> None:
    """ValueError for a schema deeper than MAX_SCHEMA_DEPTH, a local $ref that does not resolve,
    or recursion through $ref; the ``pattern``s of its strings are checked as regexes."""
    targets: dict[int, str] = {}  # id(node) -> its ref, for every node a local $ref points at
    stack = [(schema, 1)]
    while stack:  # pass 1: depth, patterns, ref targets (iterative: a deep schema is no RecursionError)
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{what}: nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):  # (_resolve refuses any but a local JSON pointer)
                target = _resolve(schema, ref, what)
                targets.setdefault(id(target), ref)
                if len(targets) > MAX_REF_TARGETS:
                    raise ValueError(f"{what}: more than {MAX_REF_TARGETS} distinct $ref targets")
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], f"{what}: pattern")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    if not targets:
        return
    # Pass 2: an edge A -> R for every $ref R found inside target A (or the root); a cycle is recursion.
    edges: dict[str, set[str]] = {}
    walk = [(schema, ("#",))]
    while walk:
        node, within = walk.pop()
        if isinstance(node, dict):
            if id(node) in targets and node is not schema:
                within = within + (targets[id(node)],)
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                for a in within:
                    edges.setdefault(a, set()).add(_canonical(targets, schema, ref, what))
            walk.extend((v, within) for v in node.values())
        elif isinstance(node, list):
            walk.extend((v, within) for v in node)
    cycle = _find_cycle(edges)
    if cycle:
        raise ValueError(f"{what}: recursive $ref ({' -> '.join(cycle)}) is not supported")


def _canonical(targets: dict[int, str], schema: object, ref: str, what: str) -> str:
    """One name per target node (two spellings of one pointer are one node)."""
    node = _resolve(schema, ref, what)
    return "#" if node is schema else targets[id(node)]


def _resolve(schema: object, ref: str, what: str) -> object:
    node = schema
    if ref in ("#", "#/"):
        return node
    if not ref.startswith("#/"):
        raise ValueError(f"{what}: $ref {ref[:80]!r}: only local JSON pointers ('#/...') are supported")
    for part in ref[2:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise ValueError(f"{what}: $ref {ref[:80]!r} does not resolve")
    return node


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(edges.get(start, ())))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(edges.get(nxt, ()))))
    return None


def check_grammar(source: str, what: str = "ebnf") -> None:
    """A GBNF or Lark grammar's repetitions: ``{m,n}`` (GBNF, and inside Lark's /regex/ literals) as
    check_regex counts them, and Lark's ``~ n..m``, each at most MAX_REPEAT. The grammar is scanned as
    one regex, without parsing its quoted literals: a literal such as ``"{20000}"`` is refused too, and
    one such as ``"["`` can hide the counts after it (llguidance's own limits still bound those)."""
    check_regex(source, what)
    for m in _LARK_COUNT.finditer(source):
        top = max(int(g) for g in m.groups() if g)
        if top > MAX_REPEAT:
            raise ValueError(f"{what}: repetition count {top} is above the limit of {MAX_REPEAT}")


def check_regex(source: str, what: str = "regex") -> None:
    """ValueError for a repetition count above MAX_REPEAT, or nested counts whose product is above
    MAX_REPEAT_PRODUCT. Only the counts are read here; llguidance checks the syntax."""
    weights = [1]  # per open group: the largest product of counts inside it
    last = 1  # the weight of the atom or group just before a quantifier
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":  # a class: skip to its closing bracket (a ']' first in the class is literal)
            j = i + 1 + (source[i + 1:i + 2] == "^")
            j += source[j:j + 1] == "]"
            while j < n and source[j] != "]":
                j += 2 if source[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            weights.append(1)
            i += 1
            continue
        if c == ")":
            last = weights.pop() if len(weights) > 1 else 1
            weights[-1] = max(weights[-1], last)
            i += 1
            continue
        m = _COUNT.match(source, i) if c == "{" else None
        if m and (m.group(1) or m.group(2)):
            counts = [int(g) for g in m.groups() if g]
            top = max(counts)
            if top > MAX_REPEAT:
                raise ValueError(f"{what}: repetition count {top} is above the limit of {MAX_REPEAT}")
            product = last * max(top, 1)
            if product > MAX_REPEAT_PRODUCT:
                raise ValueError(f"{what}: nested repetition counts multiply to {product}, above the limit of "
                                 f"{MAX_REPEAT_PRODUCT}")
            weights[-1] = max(weights[-1], product)
            last = product
            i = m.end()
            continue
        last = 1
        i += 1
