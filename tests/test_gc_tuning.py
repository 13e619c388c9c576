"""The garbage-collector settings shared by the daemons and busy applications."""

import gc

import pytest

from waltz.gc_tuning import YOUNG_THRESHOLD, tune_garbage_collector


class _Node:
    """A tracked object (instances of plain classes are)."""


@pytest.fixture
def restored_collector():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_objects_are_frozen_out_of_full_collections(restored_collector):
    before = _Node()
    tune_garbage_collector()
    after = _Node()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 20, 20)
    assert gc.isenabled()
    # Collections no longer see what existed at the call, and still see what was allocated since.
    seen = gc.get_objects()
    assert not any(obj is before for obj in seen)
    assert any(obj is after for obj in seen)


def test_calling_again_freezes_what_was_allocated_since(restored_collector):
    # (Checked by identity: the freeze count also drops as frozen objects are freed, which other threads, such
    # as pytest-xdist's, do at any time.)
    tune_garbage_collector()
    more = [_Node() for _ in range(1000)]
    assert {id(node) for node in more} <= {id(obj) for obj in gc.get_objects()}
    tune_garbage_collector()
    assert not {id(node) for node in more} & {id(obj) for obj in gc.get_objects()}
