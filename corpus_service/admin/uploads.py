"""Receiving an external-corpus upload (streamed to disk, checked line by line) and reading it back
as documents for the build.

Formats (one document is one engine chunk; drafts never cross a document boundary):
- ``jsonl``: one JSON object per line, ``{"text": "..."}`` or ``{"ids": [1, 2, ...]}``;
- ``text``: UTF-8 text, documents separated by blank lines;
- ``ids``: one document per line, token ids separated by spaces or commas.
The whole upload is checked while it streams in, so bad input is refused (400, with the line
number) before it is acknowledged; memory stays bounded by the longest line, not the file.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from pathlib import Path

FORMATS = ("jsonl", "text", "ids")
MAX_LINE_BYTES = 64 << 20  # one JSONL document / ids line
MAX_TEXT_DOC_CHARS = 1 << 20  # a blank-line-free text is cut into documents of this size


class UploadError(ValueError):
    """Bad upload content (-> 400); ``status`` 413 for size limits."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_ids(text: str, where: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UploadError(f"{where}: expected integer token ids separated by spaces or commas") from None
    _check_ids(ids, where, vocab_size)
    return ids


def _check_ids(ids: list, where: str, vocab_size: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size else ">= 0"
            raise UploadError(f"{where}: token ids must be ints {limit}, got {t!r:.40}")


def parse_jsonl_line(line: bytes, where: str, vocab_size: int, has_tokenizer: bool) -> tuple[str, object]:
    """('text', str) or ('ids', list[int])."""
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise UploadError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:  # thousands of nested brackets: hostile or broken, never a document
        raise UploadError(f"{where}: JSON nested too deeply (expected an object with \"text\" or \"ids\")") from None
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        if not has_tokenizer:
            raise UploadError(f"{where}: this namespace has no tokenizer; upload token ids ({{\"ids\": [...]}})")
        return "text", doc["text"]
    if isinstance(doc, dict) and isinstance(doc.get("ids"), list):
        _check_ids(doc["ids"], where, vocab_size)
        return "ids", doc["ids"]
    raise UploadError(f'{where}: expected an object with "text" (a string) or "ids" (a list of ints)')


class UploadSink:
    """Writes an upload to ``path`` while checking it; ``close()`` fsyncs. Not thread-safe."""

    def __init__(self, path: Path, fmt: str, max_bytes: int, vocab_size: int, has_tokenizer: bool) -> None:
        if fmt not in FORMATS:  # checked before the file exists: nothing to clean up
            raise UploadError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        if fmt == "text" and not has_tokenizer:
            raise UploadError("format 'text' needs a namespace with a tokenizer; upload token ids instead")
        self.path, self.fmt, self.max_bytes = path, fmt, max_bytes
        self.vocab_size, self.has_tokenizer = vocab_size, has_tokenizer
        self.bytes = 0
        self.lines = 0
        self._pending = b""
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._file = open(path, "wb")

    def write(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.bytes > self.max_bytes:
            raise UploadError(f"upload exceeds the limit of {self.max_bytes} bytes (max_upload_bytes)", 413)
        self._check(chunk, final=False)
        self._file.write(chunk)

    def close(self) -> None:
        """Checks the tail, then flushes and fsyncs (the caller renames and acknowledges)."""
        self._check(b"", final=True)
        if self.bytes == 0:
            raise UploadError("the upload is empty")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    def _check(self, chunk: bytes, final: bool) -> None:
        if self.fmt == "text":
            try:
                self._utf8.decode(chunk, final=final)
            except UnicodeDecodeError as e:
                raise UploadError(f"text: not valid UTF-8 near byte {self.bytes - len(chunk) + max(e.start, 0)}") from None
            return
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = b"" if final else lines.pop()
        if len(self._pending) > MAX_LINE_BYTES:
            raise UploadError(f"line {self.lines + 1}: longer than {MAX_LINE_BYTES} bytes", 413)
        for line in lines:
            self.lines += 1
            if not line.strip():
                continue
            where = f"line {self.lines}"
            if self.fmt == "jsonl":
                parse_jsonl_line(line, where, self.vocab_size, self.has_tokenizer)
            else:
                try:
                    parse_ids(line.decode("ascii"), where, self.vocab_size)
                except UnicodeDecodeError:
                    raise UploadError(f"{where}: expected ASCII digits, spaces and commas") from None


def read_documents(path: Path, fmt: str, vocab_size: int, has_tokenizer: bool) -> Iterator[tuple[int, str, object]]:
    """Yields ``(bytes_read, kind, payload)`` per document; kind is 'text' or 'ids'."""
    with open(path, "rb") as f:
        if fmt == "text":
            yield from _text_documents(f)
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if fmt == "jsonl":
                kind, payload = parse_jsonl_line(line, f"line {n}", vocab_size, has_tokenizer)
            else:
                kind, payload = "ids", parse_ids(line.decode("ascii"), f"line {n}", vocab_size)
            yield f.tell(), kind, payload


def _text_documents(f) -> Iterator[tuple[int, str, object]]:
    doc: list[str] = []
    size = 0
    for raw in f:
        line = raw.decode("utf-8")
        if not line.strip() or size + len(line) > MAX_TEXT_DOC_CHARS:
            if doc:
                yield f.tell(), "text", "".join(doc)
            doc, size = [], 0
            if not line.strip():
                continue
        doc.append(line)
        size += len(line)
    if doc:
        yield f.tell(), "text", "".join(doc)
