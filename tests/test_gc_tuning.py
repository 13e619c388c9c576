"""The garbage-collector settings shared by the daemons and busy applications."""

import gc
import weakref

import pytest

from waltz.gc_tuning import YOUNG_THRESHOLD, tune_garbage_collector


class _Node:
    other = None


@pytest.fixture
def restored_collector():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_objects_are_frozen_out_of_full_collections(restored_collector):
    long_lived = [[n] for n in range(1000)]     # tracked containers, as start-up leaves behind
    tune_garbage_collector()
    assert gc.get_freeze_count() >= len(long_lived)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 20, 20)
    # What is allocated afterwards is still collected: a reference cycle made now is freed.
    cycle = _Node()
    cycle.other = cycle
    freed = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert freed() is None


def test_calling_again_freezes_what_was_allocated_since(restored_collector):
    tune_garbage_collector()
    frozen = gc.get_freeze_count()
    more = [[n] for n in range(1000)]
    tune_garbage_collector()
    assert gc.get_freeze_count() >= frozen + len(more)
