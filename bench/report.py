"""The ending every benchmark shares: its whole result as JSON at ``out`` (folders made as needed)
and its summary as the one ``SUMMARY {...}`` line that runs are compared by."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, res: dict, summary: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("SUMMARY " + json.dumps(summary), flush=True)
