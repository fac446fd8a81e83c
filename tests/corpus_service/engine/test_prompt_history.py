"""The prompt history in the engine (csrc/prompt_history.h, NgramCorpus): a key's finished rollouts
draft for its later samples (siblings, later epochs), keys and versions are checked, versions move
forward, old versions are learned to count less and dropped after history_max_age, the history is
bounded per key and in total (least recently written keys first), its bytes per token are reported
and within the documented bound, and it survives a snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service import CorpusConfig, NgramCorpus
from corpus_service.engine.prompt_keys import default_prompt_key
from corpus_service.exceptions import StalePolicyVersionError

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
OUTPUT = [40, 41, 42, 43, 44, 45, 46, 47]
# The learned corpus off as a drafting source (its nodes weigh 0, and min_prob leaves them out): what a
# request drafts then comes from its own context, its group or its key's history alone.
HISTORY_ONLY = CorpusConfig(learned_weight=0.0, min_prob=0.01)


def run(c: NgramCorpus, rid: str, output: list[int], prompt=PROMPT, **kw) -> None:
    c.start_request(rid, prompt, **kw)
    c.extend(rid, output)
    c.finish(rid)
    c.synchronize()


def chain(c: NgramCorpus, rid: str, budget: int = 8) -> list[int]:
    """The tree's first root path (the heaviest chain)."""
    toks, parents, _ = c.draft([rid], budget).tree(0)
    out, node = [], -1
    for i, (t, p) in enumerate(zip(toks, parents)):
        if p == node:
            out.append(t)
            node = i
    return out


# ------------------------------------------------------------------ drafting from the history


def test_a_later_sample_drafts_an_earlier_siblings_rollout():
    c = NgramCorpus(HISTORY_ONLY)
    run(c, "s0", OUTPUT, prompt_key="task/1")
    assert c.prompt_history("task/1") == [(0, len(OUTPUT))]
    c.start_request("s1", PROMPT, prompt_key="task/1")
    assert chain(c, "s1") == OUTPUT
    # Another key, same prompt: no history of its own (and the learned corpus does not draft here).
    c.start_request("other", PROMPT, prompt_key="task/2")
    assert c.draft(["other"], 8).tree(0)[0] == []
    c.check_integrity()


def test_the_learned_corpus_off_really_leaves_the_history_alone():
    # The control of the test above: without a key's history nothing drafts the sibling's output.
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_bytes=0))
    run(c, "s0", OUTPUT, prompt_key="task/1")
    c.start_request("s1", PROMPT, prompt_key="task/1")
    assert c.draft(["s1"], 8).tree(0)[0] == []
    assert c.stats()["history_rollouts"] == 0


def test_an_earlier_epochs_rollout_drafts_for_the_next_policy_version():
    c = NgramCorpus(HISTORY_ONLY)
    run(c, "e0", OUTPUT, prompt_key="task/1", policy_version=0)
    assert c.announce_policy_version(1) == 1
    c.start_request("e1", PROMPT, prompt_key="task/1")  # the namespace's version: 1
    assert chain(c, "e1") == OUTPUT
    c.extend("e1", OUTPUT[:3] + [90, 91])
    c.finish("e1")
    assert c.prompt_history("task/1") == [(0, len(OUTPUT)), (1, 5)]


def test_the_default_key_is_the_hash_of_the_prompt_ids():
    c = NgramCorpus(HISTORY_ONLY)
    run(c, "a", OUTPUT)  # no key given: 'ids:' + BLAKE2b-128 of the prompt
    key = default_prompt_key(PROMPT)
    assert key.startswith("ids:") and len(key) == 4 + 32
    assert c.prompt_history(key) == [(0, len(OUTPUT))]
    c.start_request("b", PROMPT)
    assert chain(c, "b") == OUTPUT
    c.start_request("c", PROMPT + [10])  # another prompt: another key
    assert c.draft(["c"], 8).tree(0)[0] == []


def test_an_abandoned_request_adds_nothing_and_a_rollout_previews_what_finish_adds():
    c = NgramCorpus(HISTORY_ONLY)
    c.start_request("a", PROMPT, prompt_key="k")
    assert c.rollout("a") is None  # no output yet
    c.extend("a", OUTPUT)
    r = c.rollout("a")
    assert r.prompt_key == "k" and r.policy_version == 0 and r.output == len(OUTPUT)
    assert r.tokens.tolist() == PROMPT + OUTPUT  # the prompt's tail (history_context = 16) and the output
    c.finish("a", rollout=False)
    assert c.prompt_history("k") == []
    assert c.stats()["history_rollouts"] == 0


def test_batch_start_carries_keys_and_versions():
    c = NgramCorpus(HISTORY_ONLY)
    run(c, "a", OUTPUT, prompt_key="k", policy_version=3)
    c.start_requests(["b", "c"], [PROMPT, PROMPT], prompt_keys=["k", None], policy_versions=[3, None])
    assert chain(c, "b") == OUTPUT and c.draft(["c"], 8).tree(0)[0] == []
    with pytest.raises(ValueError, match="one prompt key"):
        c.start_requests(["d"], [PROMPT], prompt_keys=["k", "k"])
    with pytest.raises(ValueError, match="prompt_key"):
        c.start_requests(["d", "e"], [PROMPT, PROMPT], prompt_keys=["k", ""])
    assert not c.has_request("d")  # all checked before any starts


# ------------------------------------------------------------------ keys and versions


@pytest.mark.parametrize("key, error", [("", ValueError), ("x" * 257, ValueError), ("a\nb", ValueError),
                                        ("tab\there", ValueError), ("del\x7f", ValueError), (17, TypeError),
                                        (b"bytes", TypeError)])
def test_bad_prompt_keys_are_refused(key, error):
    c = NgramCorpus()
    with pytest.raises(error, match="prompt_key"):
        c.start_request("a", PROMPT, prompt_key=key)
    with pytest.raises(error, match="prompt_key"):
        c.start_request_unlearned("a", PROMPT, prompt_key=key)
    with pytest.raises((ValueError, TypeError)):
        c.add_rollout(key, 0, PROMPT + OUTPUT, len(OUTPUT))
    assert not c.has_request("a")


def test_good_prompt_keys_are_free_form():
    c = NgramCorpus(HISTORY_ONLY)
    for i, key in enumerate(["specbench/104", "gsm8k:train:17", "x" * 256, "ünïcode key 🙂", "ids:abc"]):
        run(c, f"r{i}", OUTPUT, prompt_key=key)
        assert c.prompt_history(key) == [(0, len(OUTPUT))]


@pytest.mark.parametrize("version, error", [(-1, ValueError), (1 << 62, ValueError), (True, TypeError),
                                            (1.0, TypeError), ("3", TypeError)])
def test_bad_policy_versions_are_refused(version, error):
    c = NgramCorpus()
    with pytest.raises(error, match="policy_version"):
        c.start_request("a", PROMPT, policy_version=version)
    with pytest.raises(error, match="version"):
        c.announce_policy_version(version)
    assert c.policy_version() == 0


def test_policy_versions_only_move_forward():
    c = NgramCorpus()
    assert c.policy_version() == 0
    assert c.announce_policy_version(2) == 2
    assert c.announce_policy_version(2) == 2  # the same again changes nothing
    with pytest.raises(StalePolicyVersionError, match="older"):
        c.announce_policy_version(1)
    assert isinstance(StalePolicyVersionError("x"), ValueError)
    assert c.advance_policy_version(1) == 2  # the commit log's form ignores an older one
    assert c.advance_policy_version(5) == 5
    assert c.policy_version() == 5 and c.stats()["policy_version"] == 5
    # A request without a version is sampled by the namespace's current one.
    c.start_request("a", PROMPT, prompt_key="k")
    c.extend("a", OUTPUT)
    assert c.rollout("a").policy_version == 5
    c.reset()  # drops the history, keeps the version
    assert c.policy_version() == 5


# ------------------------------------------------------------------ versions: dropped, learned to count less


def test_rollouts_max_age_versions_old_are_dropped_when_announced():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    run(c, "a", OUTPUT, prompt_key="k", policy_version=0)
    run(c, "b", OUTPUT, prompt_key="k", policy_version=1)
    c.announce_policy_version(1)
    assert [v for v, _ in c.prompt_history("k")] == [0, 1]
    c.announce_policy_version(2)  # version 0 is now 2 versions old
    assert [v for v, _ in c.prompt_history("k")] == [1]
    c.announce_policy_version(3)
    assert c.prompt_history("k") == [] and c.stats()["history_keys"] == 0
    assert c.stats()["history_rollouts_dropped"] == 2
    c.start_request("z", PROMPT, prompt_key="k")
    assert c.draft(["z"], 8).tree(0)[0] == []
    c.check_integrity()


def test_a_newer_rollout_drops_the_keys_rollouts_max_age_older():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    run(c, "a", OUTPUT, prompt_key="k", policy_version=0)
    run(c, "b", OUTPUT, prompt_key="k", policy_version=2)  # no announcement: the key's newest counts
    assert [v for v, _ in c.prompt_history("k")] == [2]
    # An old rollout arriving late (a slow replica) is not kept either.
    assert c.add_rollout("k", 0, PROMPT + OUTPUT, len(OUTPUT)) is False
    assert [v for v, _ in c.prompt_history("k")] == [2]


def test_a_late_rollout_older_than_the_announced_version_is_counted_not_kept(tmp_path):
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    c.announce_policy_version(4)
    assert c.add_rollout("new-key", 2, PROMPT + OUTPUT, len(OUTPUT)) is False  # 2 versions old
    assert c.stats()["history_keys"] == 0 and c.stats()["history_rollouts_dropped"] == 1
    assert c.add_rollout("new-key", 3, PROMPT + OUTPUT, len(OUTPUT)) is True
    c.save(tmp_path / "snap.ngc")
    d = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    d.load(tmp_path / "snap.ngc")  # the announced version comes back with the snapshot
    assert d.add_rollout("other", 2, PROMPT + OUTPUT, len(OUTPUT)) is False
    assert d.prompt_history("new-key") == [(3, len(OUTPUT))]
    d.check_integrity()


def test_an_old_version_behind_a_newer_one_is_dropped_too():
    # Arrival order is not version order: version 0 arrives after version 2 (a slow replica) and is
    # behind it in the key's index; when it becomes max_age old it goes all the same.
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=3))
    run(c, "a", OUTPUT, prompt_key="k", policy_version=2)
    run(c, "b", [70, 71, 72], prompt_key="k", policy_version=0)
    assert [v for v, _ in c.prompt_history("k")] == [2, 0]
    c.announce_policy_version(3)
    assert [v for v, _ in c.prompt_history("k")] == [2]
    c.check_integrity()
    c.start_request("z", PROMPT, prompt_key="k")
    assert chain(c, "z") == OUTPUT
    run(c, "c", [80], prompt_key="k", policy_version=1)
    run(c, "d", [81], prompt_key="k", policy_version=4)  # the key's newest is now 4: version 1 goes
    assert [v for v, _ in c.prompt_history("k")] == [2, 4]
    c.check_integrity()


def test_max_age_zero_keeps_every_version():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=0))
    for v in range(6):
        run(c, f"r{v}", OUTPUT, prompt_key="k", policy_version=v)
    c.announce_policy_version(100)
    assert [v for v, _ in c.prompt_history("k")] == list(range(6))


def test_a_request_does_not_draft_rollouts_max_age_versions_apart():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    run(c, "a", OUTPUT, prompt_key="k", policy_version=5)
    c.start_request("old", PROMPT, prompt_key="k", policy_version=3)  # 2 versions apart
    assert c.draft(["old"], 8).tree(0)[0] == []
    c.start_request("near", PROMPT, prompt_key="k", policy_version=4)
    assert chain(c, "near") == OUTPUT


def test_source_weights_learn_that_old_versions_count_less_than_new_ones():
    """Two rollouts of a key, from versions 3 apart, continue one context differently; the verifier
    keeps accepting what the newer policy generated. The learned multiplier of age-0 history rises,
    that of age-3 falls, and the newer continuation ranks first."""
    cfg = HISTORY_ONLY.replace(history_max_age=0, source_window=8)
    c = NgramCorpus(cfg)
    old, new = [60, 61, 62, 63], [70, 71, 72, 73]
    run(c, "old", old, prompt_key="k", policy_version=0)
    run(c, "new", new, prompt_key="k", policy_version=3)
    for i in range(40):
        c.start_request(f"q{i}", PROMPT, prompt_key="k", policy_version=3)
        c.draft([f"q{i}"], 8)
        c.extend(f"q{i}", new)  # what the current policy does
        c.finish(f"q{i}", rollout=False)  # the history stays the two rollouts
    s = c.stats()
    assert s["source_history_age0_tested_nodes"] > 0 and s["source_history_age3_tested_nodes"] > 0
    assert s["source_history_age0_accepted_nodes"] > 0 and s["source_history_age3_accepted_nodes"] == 0
    assert s["source_history_age0_weight"] > 1.0 > s["source_history_age3_weight"]
    c.start_request("last", PROMPT, prompt_key="k", policy_version=3)
    toks, parents, probs = c.draft(["last"], 8).tree(0)
    roots = {t: p for t, par, p in zip(toks, parents, probs) if par == -1}
    assert roots[70] > roots[60]


# ------------------------------------------------------------------ bounds


def test_per_key_rollout_bound_drops_the_oldest():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_rollouts=3))
    for i in range(5):
        run(c, f"r{i}", [50 + i] * (i + 1), prompt_key="k")
    assert [n for _, n in c.prompt_history("k")] == [3, 4, 5]
    assert c.stats()["history_rollouts_dropped"] == 2
    c.check_integrity()


def test_per_key_token_bound_drops_the_oldest_and_truncates_a_long_one():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_key_tokens=1024))
    rng = np.random.default_rng(1)
    for i in range(4):
        c.add_rollout("k", 0, rng.integers(100, 40000, 400, dtype=np.int32), 390)
    s = c.stats()
    assert s["history_rollouts"] == 2 and s["history_tokens"] == 800  # a third would pass 1,024 with separators
    c.add_rollout("k", 0, rng.integers(100, 40000, 3000, dtype=np.int32), 2990)
    s = c.stats()
    assert s["history_rollouts"] == 1 and s["history_rollouts_truncated"] == 1
    assert s["history_tokens"] == 1023  # the beginning of the long one, as a key may hold
    c.check_integrity()


def test_total_bound_evicts_least_recently_written_keys():
    cfg = HISTORY_ONLY.replace(history_max_bytes=int(48 * 4096))  # the smallest: 4,096 charged tokens
    c = NgramCorpus(cfg)
    assert c.stats()["history_max_charged_tokens"] == 4096
    # A small key is charged 256 + 2 per rollout + 8 tokens: 15 of them fit, not 16.
    for i in range(15):
        run(c, f"a{i}", OUTPUT, prompt_key=f"key{i}")
    assert c.stats()["history_keys"] == 15 and c.stats()["history_keys_evicted"] == 0
    run(c, "again", OUTPUT, prompt_key="key0")  # key0 is now the most recently written
    run(c, "new", OUTPUT, prompt_key="key15")
    s = c.stats()
    assert s["history_keys"] == 15 and s["history_keys_evicted"] == 1
    assert s["history_charged_tokens"] <= 4096
    assert c.prompt_history("key1") == []  # the least recently written went
    assert len(c.prompt_history("key0")) == 2 and len(c.prompt_history("key15")) == 1
    assert [r.prompt_key for r in c.history_rollouts()][-2:] == ["key0", "key15"]
    c.check_integrity()


def test_one_key_larger_than_the_total_bound_keeps_its_newest_rollouts():
    c = NgramCorpus(HISTORY_ONLY.replace(history_max_bytes=int(48 * 4096), history_max_rollouts=100))
    rng = np.random.default_rng(2)
    for i in range(20):
        c.add_rollout("big", i, rng.integers(100, 40000, 500, dtype=np.int32), 484)
    s = c.stats()
    assert 0 < s["history_charged_tokens"] <= 4096
    assert [v for v, _ in c.prompt_history("big")][-1] == 19
    c.check_integrity()


# ------------------------------------------------------------------ memory: bytes per token


def test_bytes_per_token_are_reported_and_within_the_bound():
    """The engine's own accounting on a worst-case load (random tokens: no n-gram repeats) of 60
    keys x 8 rollouts x (16 + 300) tokens: at most 48 B per stored token, and the charge per key is
    what the documented 10,000-prompt figure extrapolates from."""
    cfg = CorpusConfig()
    assert cfg.history_bytes_per_token() == 48.0
    c = NgramCorpus(cfg)
    rng = np.random.default_rng(0)
    keys, samples, out, ctx = 60, 8, 300, cfg.history_context
    for k in range(keys):
        for s in range(samples):
            assert c.add_rollout(f"p{k}", 0, rng.integers(3, 49152, ctx + out, dtype=np.int32), out)
    s = c.stats()
    stored = keys * samples * (ctx + out)
    assert s["history_tokens"] == stored and s["history_output_tokens"] == keys * samples * out
    assert 0 < s["history_bytes_per_token"] <= 48.0
    assert s["history_bytes"] == pytest.approx(s["history_bytes_per_token"] * stored)
    per_key = samples * (ctx + out) + (samples - 1) + 2 * samples + 8  # live tokens (separators), records, key
    assert s["history_charged_tokens"] == keys * per_key
    assert s["history_bytes"] <= 48 * s["history_charged_tokens"]
    # 10,000 such prompts fit the default bound (1.5 GiB): no key is evicted.
    assert 10_000 * per_key <= s["history_max_charged_tokens"]
    assert 10_000 * per_key * cfg.history_bytes_per_token() <= cfg.history_max_bytes


# ------------------------------------------------------------------ snapshots


def test_history_and_policy_version_survive_a_snapshot(tmp_path):
    c = NgramCorpus(HISTORY_ONLY)
    c.announce_policy_version(2)
    run(c, "a", OUTPUT, prompt_key="k", policy_version=1)
    run(c, "b", [33, 34, 35], prompt_key="j")
    before = [(r.prompt_key, r.policy_version, r.output, r.tokens.tolist()) for r in c.history_rollouts()]
    c.save(tmp_path / "snap.ngc")
    d = NgramCorpus(HISTORY_ONLY)
    d.load(tmp_path / "snap.ngc")
    d.check_integrity()
    assert [(r.prompt_key, r.policy_version, r.output, r.tokens.tolist()) for r in d.history_rollouts()] == before
    assert d.policy_version() == 2
    d.start_request("c", PROMPT, prompt_key="k")
    assert chain(d, "c") == OUTPUT


def test_a_snapshot_loads_under_smaller_history_bounds(tmp_path):
    c = NgramCorpus(HISTORY_ONLY)
    for i in range(6):
        run(c, f"r{i}", OUTPUT + [i], prompt_key="k", policy_version=i)
    c.save(tmp_path / "snap.ngc")
    d = NgramCorpus(HISTORY_ONLY.replace(history_max_rollouts=2))
    d.load(tmp_path / "snap.ngc")
    assert [v for v, _ in d.prompt_history("k")] == [4, 5]
    d.check_integrity()
    e = NgramCorpus(HISTORY_ONLY.replace(history_max_bytes=0))
    e.load(tmp_path / "snap.ngc")
    assert e.stats()["history_rollouts"] == 0
    e.check_integrity()
    # Saved keeping every version, loaded with max_age 2 at the saved version 6: only version 5 stays,
    # as an announcement of 6 would have left it.
    f = NgramCorpus(HISTORY_ONLY.replace(history_max_age=0))
    for i in range(6):
        run(f, f"r{i}", OUTPUT + [i], prompt_key="k", policy_version=i)
    f.announce_policy_version(6)
    f.save(tmp_path / "all.ngc")
    g = NgramCorpus(HISTORY_ONLY.replace(history_max_age=2))
    g.load(tmp_path / "all.ngc")
    assert [v for v, _ in g.prompt_history("k")] == [5] and g.policy_version() == 6
    assert g.add_rollout("k", 4, PROMPT + OUTPUT, len(OUTPUT)) is False  # 2 versions old
    g.check_integrity()


# ------------------------------------------------------------------ SGLang's window path


def test_window_path_rollout_is_the_output_after_the_first_window():
    """batch_get's extension: a request first seen with a prompt key holds its prompt then; its output
    (what later windows add) joins the key's history when its match state is erased."""
    c = NgramCorpus(HISTORY_ONLY)
    c.batch_get(["w0"], [PROMPT], [len(PROMPT)], prompt_keys=["s"], policy_versions=[2])
    full = PROMPT + OUTPUT
    c.batch_get(["w0"], [full[-8:]], [len(full)])
    c.erase_match_state(["w0"])
    (r,) = c.history_rollouts()
    assert (r.prompt_key, r.policy_version, r.output, r.tokens.tolist()) == ("s", 2, len(OUTPUT), full)
    drafts, _ = c.batch_get(["w1"], [PROMPT], [len(PROMPT)], len(OUTPUT) + 1, prompt_keys=["s"], policy_versions=[2])
    assert drafts[:len(OUTPUT) + 1].tolist() == [PROMPT[-1]] + OUTPUT
    c.erase_match_state(["w1"])  # no output: nothing to add
    assert len(c.history_rollouts()) == 1
    c.batch_get(["w2"], [PROMPT], [len(PROMPT)], prompt_keys=["s"], keep_rollouts=False)
    c.batch_get(["w2"], [full[-8:]], [len(full)])
    c.erase_match_state(["w2"])  # a replica's: its rollout goes through the commit log instead
    assert len(c.history_rollouts()) == 1
    c.check_integrity()


# ------------------------------------------------------------------ random operations against the invariants


@pytest.mark.parametrize("seed", range(4))
def test_random_rollouts_announcements_and_snapshots_keep_every_bound(seed, tmp_path):
    """Random adds (many keys, versions around the announced one and out of order, lengths up to past
    the per-key bound), announcements, drafts and snapshot round trips under small bounds: after every
    step the engine's own integrity check passes and each bound holds, the age bound included for a
    rollout that arrived after a newer one (it is not at its key's front)."""
    rng = np.random.default_rng(seed)
    cfg = HISTORY_ONLY.replace(history_max_bytes=48 * 8192, history_max_rollouts=5, history_max_key_tokens=1024,
                               history_max_age=3)
    c = NgramCorpus(cfg)
    announced = 0
    seen = {"history_keys_evicted": 0, "history_rollouts_truncated": 0}  # counters survive no reload
    for step in range(300):
        op = rng.random()
        if op < 0.75:
            key = f"k{int(rng.integers(0, 40))}"
            version = max(0, announced + int(rng.integers(-4, 3)))
            out = int(rng.integers(1, 1400))
            ctx = int(rng.integers(0, 17))
            stored = c.add_rollout(key, version, rng.integers(3, 300, ctx + out, dtype=np.int32), out)
            if announced - version >= 3:
                assert not stored  # too old when it arrives
        elif op < 0.85:
            announced += int(rng.integers(0, 2))
            c.announce_policy_version(announced)
        elif op < 0.95:
            rid = f"q{step}"
            c.start_request(rid, rng.integers(3, 300, 8).tolist(), prompt_key=f"k{int(rng.integers(0, 40))}")
            c.draft([rid], 15)
            c.extend(rid, rng.integers(3, 300, 5).tolist())
            c.finish(rid, rollout=bool(rng.integers(0, 2)))
        else:
            c.save(tmp_path / "s.ngc")
            before = [(r.prompt_key, r.policy_version, r.tokens.tolist()) for r in c.history_rollouts()]
            seen = {k: v + c.stats()[k] for k, v in seen.items()}
            c = NgramCorpus(cfg)
            c.load(tmp_path / "s.ngc")
            assert [(r.prompt_key, r.policy_version, r.tokens.tolist()) for r in c.history_rollouts()] == before
        c.check_integrity()
        s = c.stats()
        assert s["history_charged_tokens"] <= s["history_max_charged_tokens"] == 8192
        assert s["history_bytes"] <= 48 * s["history_charged_tokens"]
        per_key: dict[str, list] = {}
        for r in c.history_rollouts():
            per_key.setdefault(r.prompt_key, []).append(r)
            assert announced - r.policy_version < 3
        for rs in per_key.values():
            assert len(rs) <= 5 and sum(len(r.tokens) for r in rs) + len(rs) - 1 <= 1024
            assert max(r.policy_version for r in rs) - min(r.policy_version for r in rs) < 3
    assert all(v + c.stats()[k] > 0 for k, v in seen.items())  # the bounds were exercised


# ------------------------------------------------------------------ threads


def test_drafts_stay_safe_while_other_threads_add_announce_and_evict():
    """Keyed requests draft from their keys' histories on several threads while another adds rollouts
    under a small total bound (keys evicted under the drafters, indexes rebuilt by out-of-order
    versions) and announces versions: no crash, every draft well formed, integrity intact."""
    import threading

    cfg = HISTORY_ONLY.replace(history_max_bytes=48 * 4096, history_max_age=2, history_max_rollouts=4)
    c = NgramCorpus(cfg)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer():
        rng = np.random.default_rng(7)
        v = 0
        try:
            for i in range(3000):
                if i % 100 == 99:
                    v += 1
                    c.announce_policy_version(v)
                out = int(rng.integers(1, 200))
                c.add_rollout(f"k{int(rng.integers(0, 24))}", max(0, v - int(rng.integers(0, 2))),
                              np.concatenate([np.array(PROMPT, np.int32), rng.integers(3, 60, out, dtype=np.int32)]), out)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            stop.set()

    def drafter(t: int):
        rng = np.random.default_rng(t)
        n = 0
        try:
            while not stop.is_set():
                rid = f"t{t}r{n}"
                c.start_request(rid, PROMPT, prompt_key=f"k{int(rng.integers(0, 24))}")
                for _ in range(3):
                    toks, parents, probs = c.draft([rid], 15).tree(0)
                    assert len(toks) == len(parents) <= 15 and all(-1 <= p < i for i, p in enumerate(parents))
                    c.extend(rid, rng.integers(3, 60, 2).tolist())
                c.finish(rid, rollout=bool(n % 2))
                n += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=drafter, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[0]
    c.check_integrity()
    s = c.stats()
    assert s["history_keys_evicted"] > 0 and s["history_rollouts_dropped"] > 0
    assert s["history_charged_tokens"] <= 4096
