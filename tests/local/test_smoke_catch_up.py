"""The smoke test's wait for the clients to catch up: it waits as long as they progress, and fails on a stall."""

import pytest
from twisted.internet import defer, task

from waltz.local.smoke import _caught_up


class Clients:
    def __init__(self, marks):
        self.marks = marks

    def high_water_marks(self):
        return defer.succeed(dict(self.marks))


class App:
    name = "app"

    def __init__(self, partitions):
        self.high_water_marks = {p: -1 for p in partitions}


def test_a_slow_but_steady_catch_up_is_waited_for():
    clock, app = task.Clock(), App([0])
    d = _caught_up(clock, [Clients({0: 1000})], [app], None, stall_timeout=10)
    for _ in range(100):                      # 1000 transactions at one per 0.1 s: 100 s, far beyond 10 s
        clock.advance(5)
        app.high_water_marks[0] += 10
    clock.advance(1)
    assert app.high_water_marks[0] == 999 and not d.called
    app.high_water_marks[0] = 1000
    clock.advance(1)
    assert d.called and d.result is None


def test_a_stall_fails_with_where_each_client_stopped():
    clock, app = task.Clock(), App([0, 1])
    app.high_water_marks[1] = 5
    d = _caught_up(clock, [Clients({0: 3, 1: 5})], [app], None, stall_timeout=10)
    failures = []
    d.addErrback(failures.append)
    clock.pump([1] * 9)
    assert not failures
    clock.pump([1] * 3)
    assert len(failures) == 1
    with pytest.raises(RuntimeError, match=r"no progress for 10 s\): \{'app': \{0: \(-1, 3\), 1: \(5, 5\)\}\}"):
        failures[0].raiseException()
