"""A Dockerfile read as its instructions, for the deploy tests' checks of what the images do."""

from __future__ import annotations

from pathlib import Path


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continued lines joined."""
    out, pending = [], ""
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = pending + line
        pending = ""
        op, _, arg = full.partition(" ")
        out.append((op.upper(), arg.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    """The instructions of the image that is shipped: from the last FROM on."""
    ins = instructions(path)
    start = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[start:]
