"""``freeze_startup_heap`` (ngram_common/gc_heap.py; both servers call it once started): what exists then
leaves the garbage collector's scans, what serving creates later stays in them."""

import gc

from ngram_common.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_start_up_heap_leaves_the_scans_and_later_garbage_is_still_collected():
    before = Node()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # the interpreter's, pytest's and this module's objects
        assert not any(o is before for o in gc.get_objects())  # frozen: no generation holds it
        later = Node()
        assert any(o is later for o in gc.get_objects())
        del later
        assert gc.collect() >= 1  # serving's own cyclic garbage is still freed
    finally:
        gc.unfreeze()  # the test process's heap as it was
