"""Prompts for offline rollouts: JSONL lines with ``"prompt"`` (text), ``"prompt_ids"`` (token ids) or
chat ``"messages"``, and optionally a field naming the prompt key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpus_service import check_prompt_key

from ..model import TextCodec

PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int
    prompt_ids: list[int]
    prompt_key: str | None = None  # None: the corpus' default key (a hash of the ids)


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
            if (not isinstance(value, list) or not value
                    or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in value)):
                raise ValueError(f"{where}: messages: expected a non-empty list of {{\"role\", \"content\"}} objects")
            return codec.encode(codec.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in value]))
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


def read_prompts(path: str | Path, codec: TextCodec, vocab_size: int, key_field: str = "") -> list[Prompt]:
    """Every non-blank line of a JSONL file as a Prompt; ``key_field``: the field holding each
    line's prompt key (a str, or an int written as its decimal form), required on every line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
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
            out.append(Prompt(len(out), encode_prompt(obj, codec, vocab_size, where), key))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
