"""Prompt keys and policy versions: the rule every surface checks them by.

A prompt key names "the same prompt" across requests, replicas and time: its rollouts form the prompt
history the corpus drafts from (``csrc/prompt_history.h``). Keys are free-form bounded strings, not
the name rule of ``corpus_service/names.py``: they never become file names, and an RL loop's own
prompt ids (``specbench/104``, ``gsm8k:train:17``) should work as they are. A request without a key
gets ``default_prompt_key(prompt_ids)``: ``"ids:"`` and the BLAKE2b-128 hex digest of its prompt ids
as little-endian int32, the same in every process, version and language (``hashlib.blake2b(...,
digest_size=16)``).

A policy version is a non-negative int (the RL step whose weights sampled the request); None means
the namespace's current version, which ``announce`` moves forward.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Sequence

import numpy as np

MAX_PROMPT_KEY_CHARS = 256
MAX_POLICY_VERSION = (1 << 62) - 1
DEFAULT_KEY_PREFIX = "ids:"
PROMPT_KEY_RULE_TEXT = (f"1-{MAX_PROMPT_KEY_CHARS} characters without control characters (C0, DEL, C1 such as "
                        "U+0085), line or paragraph separators (U+2028/U+2029) or lone surrogates")
# Unicode categories a key may not contain: control (Cc: C0, DEL, C1), surrogate (Cs: only a lone one
# can be in a str; no UTF-8 carries it, so the C++ index could not take it), line and paragraph
# separator (Zl, Zp): keys are written to logs and JSON lines, where these break or fake lines.
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def default_prompt_key(prompt_ids: Sequence[int] | np.ndarray) -> str:
    """The key of a request that names none: a stable hash of its prompt ids."""
    ids = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int64).astype("<i4", copy=False))
    return DEFAULT_KEY_PREFIX + hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def prompt_key_error(key: object) -> str | None:
    """Why ``key`` is not a valid prompt key (None when it is)."""
    if not isinstance(key, str):
        return f"expected a str, got {type(key).__name__}"
    if not 1 <= len(key) <= MAX_PROMPT_KEY_CHARS:
        return f"expected {PROMPT_KEY_RULE_TEXT}, got {len(key)} characters"
    bad = next((ch for ch in key if unicodedata.category(ch) in _FORBIDDEN_CATEGORIES), None)
    if bad is not None:
        return f"expected {PROMPT_KEY_RULE_TEXT}, got U+{ord(bad):04X} at character {key.index(bad)}"
    return None


def check_prompt_key(key: object, what: str = "prompt_key") -> str | None:
    """``key`` (None stays None: the default key); ValueError (TypeError for a non-str) otherwise."""
    if key is None:
        return None
    problem = prompt_key_error(key)
    if problem is not None:
        raise (TypeError if not isinstance(key, str) else ValueError)(f"{what}: {problem}")
    return key


def check_policy_version(version: object, what: str = "policy_version") -> int:
    """The version as the engine takes it: -1 for None (the namespace's current), else an int in
    [0, 2**62)."""
    if version is None:
        return -1
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"{what}: expected a non-negative int or None, got {type(version).__name__}")
    if not 0 <= int(version) <= MAX_POLICY_VERSION:
        raise ValueError(f"{what}: expected an int in [0, 2**62), got {int(version)}")
    return int(version)
