"""Namespace tokenizers: HF ``tokenizers`` from a tokenizer.json, or rebuilt from a GGUF file
(``ngram_common.tokenizer``, which the verifier's model uses too)."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer

from ngram_common.tokenizer import PROBE_TEXT, smollm2_gguf_path, tokenizer_from_gguf

__all__ = ["PROBE_TEXT", "Tokenizers", "load_tokenizer", "probe_ids", "smollm2_gguf_path", "tokenizer_from_gguf",
           "tokenizer_name"]


def load_tokenizer(spec: str) -> Tokenizer:
    """``smollm2``, a ``.gguf`` path, or a tokenizer.json path."""
    if spec == "smollm2":
        return tokenizer_from_gguf(smollm2_gguf_path())
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: no file at {path} (expected tokenizer.json, a .gguf file, or 'smollm2')")
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    return Tokenizer.from_file(os.fspath(path))


def tokenizer_name(spec: str | None) -> str:
    """What clients are told about a tokenizer spec: a file's name, never the server's path."""
    if not spec:
        return ""
    return spec if spec == "smollm2" else Path(spec).name


def probe_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids


class Tokenizers:
    """Each namespace's tokenizer, loaded on first use (a GGUF takes seconds to read; serving drafts
    never needs it, only text uploads do)."""

    def __init__(self, specs: dict[str, str | None]) -> None:
        import threading

        self._specs = specs
        self._lock = threading.Lock()
        self._loaded: dict[str, Tokenizer] = {}
        self._probes: dict[str, list[int]] = {}

    def has(self, namespace: str) -> bool:
        return bool(self._specs.get(namespace))

    def get(self, namespace: str) -> Tokenizer:
        spec = self._specs.get(namespace)
        if not spec:
            raise ValueError(f"namespace '{namespace}' has no tokenizer (configure tokenizer=... in its spec)")
        with self._lock:
            if namespace not in self._loaded:
                self._loaded[namespace] = load_tokenizer(spec)
            return self._loaded[namespace]

    def name(self, namespace: str) -> str:
        return tokenizer_name(self._specs.get(namespace))

    def probe(self, namespace: str) -> list[int]:
        """PROBE_TEXT's ids under the namespace's tokenizer ([] without one); loads it on first use
        (seconds for a GGUF: call off the event loop). Raises if the tokenizer cannot be loaded."""
        if not self.has(namespace):
            return []
        probe = self._probes.get(namespace)
        if probe is None:
            probe = self._probes[namespace] = probe_ids(self.get(namespace))
        return probe
