"""kill -9 at random moments during uploads, commits and snapshots (bench/crash_soak.py, bounded):
every acknowledged upload and every commit covered by an acknowledged snapshot survives, the
integrity check holds, and a damaged snapshot is refused and reported. The 50-trial run is
``python3 bench/crash_soak.py`` (docs/reliability.md)."""

from __future__ import annotations

import os
import random

from bench import crash_soak

TRIALS = int(os.environ.get("NGRAM_CRASH_TRIALS", "3"))


def test_kill9_trials_keep_every_acknowledgement(tmp_path):
    rng = random.Random(int(os.environ.get("NGRAM_CRASH_SEED", "7")))
    exp = crash_soak.Expected()
    ops, trial = 0, 0
    # TRIALS trials, then more (with later kills) until an upload and a snapshot were acknowledged
    # at least once: on a loaded machine the first kills can all come before any acknowledgement.
    while trial < TRIALS or not (exp.uploads and exp.durable):
        assert trial < TRIALS + 6, "the workload acknowledged nothing in any trial: the trials checked nothing"
        r = crash_soak.run_trial(tmp_path, exp, rng, trial, max_kill_s=1.0 if trial < TRIALS else 3.0,
                                 corrupt=trial == 1)
        assert not r.failures, r
        ops += sum(r.ops.values())
        trial += 1
    assert ops > 0

    # The checker itself can fail: lose an acknowledged upload behind the server's back.
    lost = sorted(exp.uploads)[0]
    for path in [tmp_path / "snapshots" / "default.ngc", *(tmp_path / "uploads" / "default").glob(f"{lost}.*")]:
        path.unlink()
    srv = crash_soak._server(tmp_path, 0.25).start()
    try:
        failures, _, _ = crash_soak.verify(srv, exp, tmp_path, timeout=10.0)  # the lost one never comes
    finally:
        srv.stop()
    assert any(lost in f and "missing" in f for f in failures), failures
    assert any("covered by an acknowledged snapshot" in f for f in failures), failures
