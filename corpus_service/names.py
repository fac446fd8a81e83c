"""The one name rule of namespaces, corpora and client names, shared by REST, gRPC, the CLI and the
token file. Names become file names (``uploads/NS/NAME.data``): no '/', no leading '.', no control
characters, no whitespace. Matched in full: ``$`` in ``re.match`` also matches before a trailing
newline, which once let "evil\\n" create a file "evil\\n.data" beside "evil"."""

from __future__ import annotations

import re

NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # fullmatch only
NAME_RULE_TEXT = "1-64 characters of letters, digits, '_', '.', '-' (not starting with a symbol)"


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RULE.fullmatch(name) is not None


def check_name(name: object, what: str) -> str:
    """``name`` if it follows the rule, else ValueError naming ``what`` (the value shown escaped)."""
    if not is_valid_name(name):
        raise ValueError(f"{what}: expected {NAME_RULE_TEXT}, got {name!r:.80}")
    return name


def check_namespace_name(name: object) -> str:
    return check_name(name, "namespace")


def check_corpus_name(name: object) -> str:
    return check_name(name, "corpus name")
