"""Regenerates the committed Python code for proto/ under corpus_service/_proto/.

    python3 scripts/gen_proto.py            # rewrite corpus_service/_proto
    python3 scripts/gen_proto.py --out DIR  # write elsewhere (the test diffs the two)

protoc writes imports relative to the proto root (``from ngram_corpus.v1 import ...``); they are
rewritten to the package the code lives in, so nothing has to touch sys.path.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PACKAGE = "corpus_service._proto"
DEFAULT_OUT = REPO / "corpus_service" / "_proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only needed to regenerate

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpcio-tools
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p) for p in protos]]
    out.mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for path in sorted(out.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = re.sub(r"^from ngram_corpus\.", f"from {PACKAGE}.ngram_corpus.", path.read_text(), flags=re.M)
        path.write_text(text)
        written.append(path)
    for d in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        if d.name != "__pycache__" and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
            written.append(d / "__init__.py")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
