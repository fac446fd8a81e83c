"""The committed generated code is exactly what grpcio-tools makes of proto/ today."""

from __future__ import annotations

import importlib.util
import sys

from tests.corpus_service.service_fixtures import REPO


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = REPO / "corpus_service" / "_proto"
    fresh = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    ours = {p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert fresh == ours, "regenerate with: python3 scripts/gen_proto.py"
    for rel in sorted(fresh):
        assert (tmp_path / rel).read_text() == (committed / rel).read_text(), f"{rel} is stale: python3 scripts/gen_proto.py"


def test_proto_package_is_versioned():
    from corpus_service._proto.ngram_corpus.v1 import corpus_pb2

    assert corpus_pb2.DESCRIPTOR.package == "ngram_corpus.v1"
    assert corpus_pb2.DESCRIPTOR.name == "ngram_corpus/v1/corpus.proto"
