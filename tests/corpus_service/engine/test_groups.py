"""Request groups in the engine: members draft from each other at once, the shared prompt counts once,
the group lives as long as a member, and bad group keys are refused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from corpus_service import NgramCorpus

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_member_drafts_its_siblings_just_committed_continuation():
    c = NgramCorpus()
    c.start_request("a", PROMPT, group="g")
    c.start_request("b", PROMPT, group="g")
    c.start_request("x", PROMPT)  # same prompt, no group
    c.extend("a", [10, 11, 12, 13, 14, 15])
    c.extend("b", [10])
    c.extend("x", [10])
    toks, parents, _ = c.draft(["b"], 8).tree(0)
    assert toks[:5] == [11, 12, 13, 14, 15] and parents[:5] == [-1, 0, 1, 2, 3]
    # Not a member: a's tokens are still pending for the learned corpus, so x has nothing to draft.
    assert c.draft(["x"], 8).tree(0)[0] == []
    c.check_integrity()


def test_a_member_at_the_prompt_end_drafts_a_sibling_that_is_ahead():
    # The shared prompt's occurrences count once, but not the member's current position: the
    # sibling's copy of the prompt end continues into the sibling's output.
    c = NgramCorpus()
    c.start_request("a", PROMPT, group="g")
    c.extend("a", [10, 11, 12])
    c.start_request("b", PROMPT, group="g")
    assert c.draft(["b"], 4).tree(0)[0] == [10, 11, 12]


def test_the_shared_prompt_counts_once():
    # A member whose siblings committed nothing yet drafts exactly what a lone request drafts:
    # the siblings' copies of the prompt add no votes.
    prompt = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6]
    c = NgramCorpus(learn_prompts=False)
    for rid in ("a", "b", "c"):
        c.start_request(rid, prompt, group="g")
    c.start_request("solo", prompt)
    solo = c.draft(["solo"], 6)
    assert solo.tree(0)[0]
    for rid in ("a", "b", "c"):  # the founder indexes the prompt, b and c draft it from there
        assert c.draft([rid], 6).tree(0) == solo.tree(0)
    c.extend("a", [7, 7])  # the founder moves on: the prompt is still every member's own context
    c.extend("solo", [9, 9])
    c.extend("b", [9, 9])
    assert c.draft(["b"], 6).tree(0) == c.draft(["solo"], 6).tree(0)
    c.check_integrity()


def test_later_members_do_not_index_the_shared_prompt():
    prompt = list(range(1, 2001))
    c = NgramCorpus()
    c.start_request("a", prompt, group="g")
    c.start_request("b", prompt, group="g")
    c.start_request("solo", prompt)
    # The member keeps the prompt tail as context: matches reach across into its output.
    c.extend("a", [1, 2, 3, 4, 5])
    c.extend("b", [1, 2])
    assert c.draft(["b"], 3).tree(0)[0] == [3, 4, 5]
    c.extend("b", [3])
    c.finish_batch(["a", "b"])
    c.synchronize()
    c.check_integrity()


def test_siblings_chunks_in_the_learned_corpus_are_not_counted_again():
    # Small chunks reach the learned corpus while the group lives; a member drafts from its
    # siblings' indexes and skips their chunks, so drafts equal those of an engine that learns nothing.
    def run(c: NgramCorpus) -> list:
        c.start_request("a", PROMPT, group="g")
        c.start_request("b", PROMPT, group="g")
        c.extend("b", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
        c.extend("a", [10])
        c.finish("b")  # an ended member stays a source while the group lives
        c.synchronize()
        return c.draft(["a"], 8).tree(0)

    learning = NgramCorpus(flush_tokens=2)
    silent = NgramCorpus(flush_tokens=1 << 20, learn_prompts=False)
    got = run(learning)
    assert learning.stats()["learned_tokens"] >= 10
    assert got[0][:3] == [11, 12, 13]
    assert got == run(silent)
    learning.check_integrity()


def test_later_members_do_not_learn_the_shared_prompt_again():
    c = NgramCorpus(flush_tokens=1)
    for rid in ("a", "b", "c"):
        c.start_request(rid, PROMPT, group="g")
    c.start_request("d", PROMPT + [42], group="g")  # only what it does not share is new
    c.synchronize()
    c.finish_batch(["a", "b", "c", "d"])
    c.synchronize()
    assert c.stats()["learned_tokens"] == len(PROMPT) + 1


def test_group_lives_as_long_as_a_member():
    c = NgramCorpus()
    c.start_request("a", PROMPT, group="g")
    c.start_request("b", PROMPT, group="g")
    assert c.stats()["live_groups"] == 1
    c.extend("a", [10, 11, 12, 13])
    c.finish("a")
    c.extend("b", [10])
    assert c.draft(["b"], 4).tree(0)[0][:3] == [11, 12, 13]  # a ended but is still a source
    assert c.stats()["live_groups"] == 1
    c.check_integrity()
    c.finish("b")
    c.synchronize()
    assert c.stats()["live_groups"] == 0 and c.stats()["live_requests"] == 0
    c.check_integrity()
    # The key starts a fresh group: the old members are gone.
    c.start_request("n", [99], group="g")
    c.start_request("m", [98], group="g")
    c.extend("m", [20, 21, 22])
    c.extend("n", [20])
    assert c.draft(["n"], 4).tree(0)[0] == [21, 22]
    c.erase_match_state(["n", "m"])
    assert c.stats()["live_groups"] == 0


def test_idle_members_expire_with_their_group():
    c = NgramCorpus(request_ttl_s=0.05)
    c.start_request("a", PROMPT, group="g")
    c.start_request("b", PROMPT, group="g")
    time.sleep(1.2)  # the sweep runs at most once a second
    c.start_request("new", [3])
    assert not c.has_request("a") and c.stats()["live_groups"] == 0
    c.check_integrity()


def test_reset_and_snapshots_leave_no_group_behind(tmp_path):
    c = NgramCorpus(flush_tokens=2)
    c.start_request("a", PROMPT, group="g")
    c.start_request("b", PROMPT, group="g")
    c.extend("a", [10, 11, 12])
    c.save(tmp_path / "c.ngc")  # live requests are not persisted, groups neither
    fresh = NgramCorpus()
    fresh.load(tmp_path / "c.ngc")
    assert fresh.stats()["live_groups"] == 0 and fresh.stats()["learned_tokens"] == c.stats()["learned_tokens"]
    c.reset()
    assert c.stats()["live_groups"] == 0 and not c.has_request("a")
    c.start_request("a", PROMPT, group="g")  # the key and ids are free again
    c.check_integrity()


def test_unlearned_members_draft_from_each_other():
    c = NgramCorpus(flush_tokens=1)
    c.start_request_unlearned("a", PROMPT, group="g")
    c.start_request_unlearned("b", PROMPT, group="g")
    c.extend("a", [10, 11, 12])
    c.extend("b", [10])
    assert c.draft(["b"], 4).tree(0)[0] == [11, 12]
    c.finish_batch(["a", "b"])
    c.synchronize()
    assert c.stats()["learned_tokens"] == 0


def test_batch_start_with_groups():
    c = NgramCorpus()
    c.start_requests(["a", "b", "x"], [PROMPT, PROMPT, PROMPT], groups=["g", "g", None])
    c.extend_batch(["a", "b", "x"], [[10, 11, 12], [10], [10]])
    batch = c.draft(["a", "b", "x"], 4)
    assert batch.tree(1)[0] == [11, 12] and batch.tree(2)[0] == []


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda c: c.start_request("a", [1], group=""), ValueError, "group: expected 1-1024 characters"),
        (lambda c: c.start_request("a", [1], group="g" * 1025), ValueError, "group: expected 1-1024"),
        (lambda c: c.start_request("a", [1], group=5), TypeError, "group: expected str or None"),
        (lambda c: c.start_requests(["a", "b"], [[1], [2]], groups=["g"]), ValueError, "one group"),
        (lambda c: c.start_requests(["a"], [[1]], groups="g"), ValueError, "one group"),
        (lambda c: c.start_request("live", [1], group="g"), ValueError, "already live"),
        (lambda c: c.start_request("a", [-1], group="g"), ValueError, "token ids must be"),
    ],
)
def test_bad_group_input_is_refused_and_changes_nothing(call, error, message):
    c = NgramCorpus()
    c.start_request("live", [1, 2], group="g")
    with pytest.raises(error, match=message):
        call(c)
    assert c.stats()["live_groups"] == 1 and c.stats()["live_requests"] == 1
    c.check_integrity()
    c.finish("live")
    assert c.stats()["live_groups"] == 0


def test_concurrent_members_extend_and_draft():
    # Drafts read siblings under the group's shared lock while members append under the exclusive
    # one: many threads on one group must neither deadlock nor corrupt an index.
    c = NgramCorpus(flush_tokens=8)
    ids = [f"m{i}" for i in range(4)]
    for rid in ids:
        c.start_request(rid, PROMPT, group="g")
    rng = np.random.default_rng(0)
    runs = {rid: rng.integers(0, 50, size=(150, 3)) for rid in ids}
    errors: list[BaseException] = []

    def work(rid: str) -> None:
        try:
            for step in runs[rid]:
                c.draft([rid], 8)
                c.extend(rid, step)
            c.finish(rid)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors
    c.check_integrity()
    assert c.stats()["live_groups"] == 0


def test_a_group_keeps_a_bounded_number_of_members():
    # A client reusing one key for every request: ended members beyond the bound are let go (their
    # tokens stay learned) and live members beyond it are refused, so a group never grows unbounded.
    c = NgramCorpus()
    c.start_request("keep", PROMPT, group="g")
    for i in range(100):
        c.start_request(i, PROMPT, group="g")
        c.extend(i, [10 + i % 7])
        c.finish(i)
    c.synchronize()
    c.check_integrity()
    assert c.stats()["live_groups"] == 1
    for i in range(63):
        c.start_request(f"live{i}", PROMPT, group="g")
    with pytest.raises(ValueError, match="64 live members"):
        c.start_request("one-too-many", PROMPT, group="g")
    assert not c.has_request("one-too-many")
    c.finish_batch(["keep"] + [f"live{i}" for i in range(63)])
    assert c.stats()["live_groups"] == 0
    c.check_integrity()


def test_members_started_concurrently_keep_the_group_consistent():
    # Starts racing each other for one new group: whoever registers first is the founder, a start
    # that looked the group up before it existed indexes its whole prompt; drafts work for all.
    c = NgramCorpus()
    errors: list[BaseException] = []

    def start(t: int) -> None:
        try:
            for g in range(20):
                c.start_request(f"t{t}g{g}", PROMPT, group=f"g{g}")
                c.extend(f"t{t}g{g}", [10 + t])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and c.stats()["live_groups"] == 20
    c.check_integrity()
    assert len(c.draft([f"t{t}g{g}" for t in range(4) for g in range(20)], 4)) == 80
    c.finish_batch([f"t{t}g{g}" for t in range(4) for g in range(20)])
    assert c.stats()["live_groups"] == 0
    c.check_integrity()
