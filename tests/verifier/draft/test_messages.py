"""The child-process hop's messages (``verifier.draft.messages``): typed, versioned, checked on receipt."""

import pickle
import struct

import numpy as np
import pytest

from corpus_service import DraftBatch
from verifier.draft.calls import Extend, Finish, StartRequest
from verifier.draft.messages import (PROTOCOL_VERSION, TO_CHILD, TO_PARENT, Calls, ClientSettings, Close, Configure,
                                     DraftAsk, Failure, Frames, Note, Reachable, Ready, Trees, encode)


def _batch() -> DraftBatch:
    return DraftBatch(np.arange(6, dtype=np.int32).reshape(2, 3), np.array([[-1, 0, 1], [-1, 0, 0]], np.int32),
                      np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3), np.array([3, 2], np.int32))


def _split_feed(frames: Frames, data: bytes, step: int = 5) -> list:
    got = []
    for i in range(0, len(data), step):  # a pipe delivers arbitrary pieces
        got += frames.feed(data[i:i + step])
    return got


def test_every_message_round_trips_split_anywhere():
    to_child = [Configure(ClientSettings("127.0.0.1:1", token="t")), Close(),
                Calls([StartRequest("r", [1, 2], "g"), Extend([("r", [3])]), Finish("r"),
                       StartRequest("s", [4], None, "rollout/a", 7), Finish("s", False)]),
                DraftAsk(7, ["r", "s"], 8, 4)]
    got = _split_feed(Frames(TO_CHILD), b"".join(map(encode, to_child)))
    assert got == to_child and [type(c) for c in got[2].calls] == [StartRequest, Extend, Finish, StartRequest, Finish]
    assert (got[2].calls[3].prompt_key, got[2].calls[3].policy_version, got[2].calls[4].rollout) == ("rollout/a", 7, False)
    b = _batch()
    to_parent = [Ready(), Failure(None, Note("NOT_FOUND", "x")), Reachable(), Trees(7, b, True)]
    got = _split_feed(Frames(TO_PARENT), b"".join(map(encode, to_parent)))
    assert got[:3] == to_parent[:3]
    t = got[3]
    assert (t.ticket, t.capped) == (7, True)
    for want, have in zip((b.tokens, b.parents, b.probs, b.counts), (t.batch.tokens, t.batch.parents,
                                                                     t.batch.probs, t.batch.counts)):
        assert have.dtype == want.dtype and np.array_equal(have, want)
    t.batch.tokens[0, 0] = 5  # the decoded arrays are the caller's to change


def test_a_message_for_the_other_side_is_refused():
    with pytest.raises(ValueError, match="unknown message Ready: expected one of Configure"):
        Frames(TO_CHILD).feed(encode(Ready()))
    with pytest.raises(ValueError, match="unknown message DraftAsk"):
        Frames(TO_PARENT).feed(encode(DraftAsk(1, ["r"], 4, 4)))


def test_ad_hoc_tuples_and_foreign_classes_are_refused():
    with pytest.raises(ValueError, match="not a message"):
        encode(("draft", 1, ["r"], 4, 4))
    body = pickle.dumps(("draft", 1, ["r"], 4, 4))  # a tuple is built, but it is no message
    frame = struct.pack("<IBB", len(body), PROTOCOL_VERSION, 0) + body
    with pytest.raises(ValueError, match="unknown message tuple"):
        Frames(TO_CHILD).feed(frame)
    body = pickle.dumps(np.zeros(2))  # unpickling builds only the listed classes
    frame = struct.pack("<IBB", len(body), PROTOCOL_VERSION, 0) + body
    with pytest.raises(ValueError, match="unknown message class"):
        Frames(TO_CHILD).feed(frame)


def test_another_protocol_version_or_frame_kind_is_refused():
    frame = bytearray(encode(Close()))
    frame[4] = PROTOCOL_VERSION + 1
    with pytest.raises(ValueError, match=f"protocol version {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}"):
        Frames(TO_CHILD).feed(bytes(frame))
    with pytest.raises(ValueError, match="frame kind"):
        Frames(TO_CHILD).feed(struct.pack("<IBB", 1, PROTOCOL_VERSION, 9) + b"x")
    with pytest.raises(ValueError, match="a trees frame of 2 bytes, shorter than its header"):
        Frames(TO_PARENT).feed(struct.pack("<IBB", 2, PROTOCOL_VERSION, 1) + b"xx")
    head = struct.pack("<qiiB", 1, 2, 3, 0)  # 2 x 3 trees announced, none sent
    with pytest.raises(ValueError, match=f"a trees frame of {len(head)} bytes for 2 x 3"):
        Frames(TO_PARENT).feed(struct.pack("<IBB", len(head), PROTOCOL_VERSION, 1) + head)
    body = encode(Close())[6:-2]  # a truncated pickle
    with pytest.raises(ValueError, match="does not unpickle"):
        Frames(TO_CHILD).feed(struct.pack("<IBB", len(body), PROTOCOL_VERSION, 0) + body)


@pytest.mark.parametrize("msg, what", [
    (DraftAsk(1, ["r"], 2, 4), "budget 4 and nodes 2"),
    (DraftAsk(1, [3], 4, 4), "request ids that are not strings"),
    (DraftAsk(True, ["r"], 4, 4), "a non-int field"),
    (Calls([("finish", ("r",))]), "a call of type tuple"),
    (Calls([Finish(3)]), "a request id that is not a string"),
    (Calls([Extend({"r": [1]})]), "bad extend items"),
    (Calls([StartRequest("r", [1], None, 5)]), "a bad prompt_key or policy_version"),
    (Calls([StartRequest("r", [1], None, "k", "7")]), "a bad prompt_key or policy_version"),
    (Calls([Finish("r", "no")]), "a rollout flag that is not a bool"),
    (Configure(ClientSettings("h:1", timeout_s=0)), "a timeout that is not a number > 0"),
    (Failure("1", Note("", "x")), "a non-int ticket"),
])
def test_fields_are_checked_on_receipt(msg, what):
    side = TO_CHILD if type(msg) in TO_CHILD else TO_PARENT
    with pytest.raises(ValueError, match=what):
        Frames(side).feed(encode(msg))
