"""`freeze_gc_heap`: garbage first collected, then everything alive kept out of full collections."""

from __future__ import annotations

import gc
import weakref

from outrider.proto.gc_heap import freeze_gc_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_collects_then_freezes_what_is_alive():
    kept = Node()
    garbage = Node()
    garbage.other = garbage  # a cycle only the collector frees
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_gc_heap("test")
        assert dead() is None, "garbage frozen with the heap would never be freed"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # full collections skip it
        made_later = Node()
        assert any(o is made_later for o in gc.get_objects())  # still collected as before
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
