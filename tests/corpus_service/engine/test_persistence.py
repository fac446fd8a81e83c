"""Save/load round trips on real files, and refusal of corrupt, truncated or foreign files."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service import NgramCorpus
from corpus_service.exceptions import CorruptSnapshotError


def populated() -> NgramCorpus:
    c = NgramCorpus(flush_tokens=16)
    rng = np.random.default_rng(3)
    for r in range(20):
        c.start_request(r, rng.integers(0, 30, 10))
        c.extend(r, rng.integers(0, 30, 50))
        c.finish(r)
    c.load_external_corpus_named("docs", [rng.integers(0, 30, 100), rng.integers(0, 30, 7)])
    c.commit_external_corpus_load("docs", 107)
    c.start_request("live", [1, 2, 3])
    c.extend("live", [4, 5])  # pending commits of a live request are part of the snapshot
    return c


def drafts(c: NgramCorpus) -> list:
    out = []
    for i, ctx in enumerate([[1, 2], [5, 6, 7], [29], [3, 3, 3]]):
        c.start_request(f"probe{i}", ctx)
        out.append(c.draft([f"probe{i}"], 10).tree(0))
        c.finish(f"probe{i}")
    return out


def test_round_trip(tmp_path):
    a = populated()
    path = tmp_path / "corpus.ngc"
    a.save(path)
    b = NgramCorpus(flush_tokens=16)
    b.load(path)
    b.check_integrity()
    assert a.learned_tokens().tolist() == b.learned_tokens().tolist()
    assert a.list_external_corpora() == b.list_external_corpora()
    assert drafts(a) == drafts(b)


def corrupt_cases(data: bytes):
    yield "flipped byte", data[:100] + bytes([data[100] ^ 0x40]) + data[101:], "checksum"
    yield "truncated", data[: len(data) // 2], "truncated"
    yield "empty", b"", "header"
    yield "foreign", b"PK\x03\x04" + data[4:], "header"
    yield "appended", data + b"junk", "truncated or oversized"
    yield "bad version", data[:8] + (99).to_bytes(4, "little") + data[12:], "version"


def test_corrupt_files_are_refused_and_change_nothing(tmp_path):
    a = populated()
    good = tmp_path / "good.ngc"
    a.save(good)
    data = good.read_bytes()
    b = NgramCorpus(flush_tokens=16)
    b.batch_put([[9, 9, 9]])
    b.synchronize()
    before = b.learned_tokens().tolist()
    for name, blob, message in corrupt_cases(data):
        bad = tmp_path / f"{name.replace(' ', '_')}.ngc"
        bad.write_bytes(blob)
        with pytest.raises(CorruptSnapshotError, match=message):
            b.load(bad)
        assert b.learned_tokens().tolist() == before, name
    with pytest.raises(OSError, match="cannot open"):
        b.load(tmp_path / "missing.ngc")


def test_incompatible_orders_are_refused(tmp_path):
    a = populated()
    a.save(tmp_path / "c.ngc")
    with pytest.raises(CorruptSnapshotError, match="learned_orders"):
        NgramCorpus(learned_orders=(1, 3)).load(tmp_path / "c.ngc")


def test_save_is_atomic(tmp_path):
    a = populated()
    path = tmp_path / "c.ngc"
    a.save(path)
    first = path.read_bytes()
    a.batch_put([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    a.save(path)
    assert path.read_bytes() != first
    assert not (tmp_path / "c.ngc.tmp").exists()
