"""Prompts for offline rollouts: JSONL lines with ``"prompt"`` (text), ``"prompt_ids"`` (token ids) or
chat ``"messages"``, and optionally a field naming the prompt key.

The whole file is read and checked before anything runs or any output is written; every error names
the file and line: invalid UTF-8, JSON nested deeper than ``MAX_DEPTH``, lone surrogates (a ``\ud800``
escape), chat messages by the HTTP API's rules (``verifier/api/schemas.py``'s roles and text parts),
and (``check_lengths``) a prompt that does not fit ``--max-len``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpus_service import check_prompt_key

from ..model import TextCodec

PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")
MAX_DEPTH = 64  # nested objects/arrays of one line (a prompt line needs 4)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int
    prompt_ids: list[int]
    prompt_key: str | None = None  # None: the corpus' default key (a hash of the ids)
    where: str = ""  # FILE:LINE it came from (for errors found later)


def encode_prompt(item: Any, codec: TextCodec, vocab_size: int, where: str) -> list[int]:
    """Token ids of one prompt: a str (encoded as is), a list of ints (ids), or a dict with one of
    ``PROMPT_FIELDS`` (messages through the chat template). ValueError says what is wrong and where."""
    if isinstance(item, dict):
        present = [f for f in PROMPT_FIELDS if f in item]
        if len(present) != 1:
            raise ValueError(f"{where}: expected exactly one of {', '.join(PROMPT_FIELDS)}, got "
                             f"{', '.join(present) or 'none'}")
        field = present[0]
        value = item[field]
        if field == "messages":
            messages = _chat_messages(value, where)
            try:
                return codec.encode(codec.apply_chat_template(messages))
            except Exception as e:  # a template that fails on these messages (as the HTTP API's 400)
                raise ValueError(f"{where}: messages: the chat template failed: {str(e)[:200]}") from None
        item, where = value, f"{where}: {field}"
    if isinstance(item, str):
        if not item:
            raise ValueError(f"{where}: expected a non-empty prompt")
        return codec.encode(item)
    if isinstance(item, (list, tuple)):
        if not item or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in item):
            raise ValueError(f"{where}: expected a non-empty list of token ids in [0, {vocab_size})")
        return [int(t) for t in item]
    raise ValueError(f"{where}: expected a str, a list of token ids or an object, got {type(item).__name__}")


def _chat_messages(value: Any, where: str) -> list[dict[str, str]]:
    """The messages as the chat template takes them, by the HTTP API's rules (one schema for both)."""
    from pydantic import ValidationError

    from ..api.schemas import ChatMessage

    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages: expected a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(value):
        try:
            out.append(ChatMessage.model_validate(m).for_template())
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            msg = first.get("msg", "invalid").removeprefix("Value error, ")
            raise ValueError(f"{where}: messages.{i}{'.' + loc if loc else ''}: {msg}") from None
    return out


def _check_nesting(obj: Any, where: str) -> None:
    """ValueError for nesting deeper than MAX_DEPTH or a string with a lone surrogate (iterative)."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise ValueError(f"{where}: a string contains a lone surrogate (a \\ud800-\\udfff escape): not "
                                 "valid Unicode text")
        elif isinstance(node, dict):
            stack.extend((v, depth + 1) for v in (*node.keys(), *node.values()))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def read_prompts(path: str | Path, codec: TextCodec, vocab_size: int, key_field: str = "") -> list[Prompt]:
    """Every non-blank line of a JSONL file as a Prompt; ``key_field``: the field holding each
    line's prompt key (a str, or an int written as its decimal form), required on every line.
    ValueError naming FILE:LINE for the first bad line."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except RecursionError:
                raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
            except ValueError as e:  # JSONDecodeError, an int of more than 4300 digits
                raise ValueError(f"{where}: not valid JSON ({str(e)[:160]})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            _check_nesting(obj, where)
            key = None
            if key_field:
                if key_field not in obj:
                    raise ValueError(f"{where}: no prompt key field {key_field!r}")
                key = obj[key_field]
                key = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
                try:
                    check_prompt_key(key, f"{where}: {key_field}")
                except TypeError as e:
                    raise ValueError(str(e)) from None
            out.append(Prompt(len(out), encode_prompt(obj, codec, vocab_size, where), key, where))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def check_lengths(prompts: list[Prompt], max_len: int, max_new: int) -> None:
    """ValueError naming the first prompt whose tokens and ``max_new`` new ones do not fit ``max_len``
    (the engine's rule: prompt + max_tokens + 1 <= max_len)."""
    for p in prompts:
        if len(p.prompt_ids) + max_new + 1 > max_len:
            raise ValueError(f"{p.where or f'prompt {p.index}'}: the prompt's {len(p.prompt_ids)} tokens + --max-new "
                             f"{max_new} do not fit --max-len {max_len} (at most {max_len - max_new - 1} prompt tokens)")
