"""Lock hashes and the optimistic lock table: slots, estimates, lock kinds, in-flight conflicts,
and the property that no conflicting transaction ever gets through."""

import pathlib
import random
import re
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waltz.protocols.client_messages import AppendRequest
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId
from waltz.server.locks import (
    NUM_HASH_FUNCTIONS, LockCheck, LockOutcome, LockRequest, LockTable, lock_slots)


def crc32c_bitwise(data: bytes) -> int:
    """An independent, slow CRC32C (reflected polynomial 0x82F63B78), signed like the wire."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    crc ^= 0xFFFFFFFF
    return crc - (1 << 32) if crc >= (1 << 31) else crc


# -- lock hashes ------------------------------------------------------------------------------

#: Golden values, also printed in docs/protocol.md ("Lock hashes").
GOLDEN_HASHES = [
    (("account", 42), 820683174),
    (("test", 0), -828252734),
    (("", -1), 1214729159),
]


@pytest.mark.parametrize("lock, expected", GOLDEN_HASHES)
def test_lock_hash_golden_values(lock, expected):
    assert lock_hash(*lock) == expected


@pytest.mark.parametrize("name, lock_id", [("account", 42), ("withdrawal", -7), ("naïve €", 2 ** 63 - 1),
                                           ("x", -2 ** 63)])
def test_lock_hash_is_crc32c_of_utf8_name_and_big_endian_id(name, lock_id):
    expected = crc32c_bitwise(name.encode("utf-8") + struct.pack(">q", lock_id))
    assert lock_hash(name, lock_id) == expected
    assert -2 ** 31 <= lock_hash(name, lock_id) < 2 ** 31


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_the_documented_lock_hashes_and_slots_are_what_the_code_computes():
    section = re.search(r"^## Lock hashes\n(.*?)(?=^## |\Z)", DOC.read_text(encoding="utf-8"), re.M | re.S).group(1)
    rows = re.findall(r'^\| `\("(.*?)", (-?\d+)\)` \| (-?\d+) \| `([0-9a-f]{8})` \| ([\d, ]+) \|$', section, re.M)
    assert len(rows) == len(GOLDEN_HASHES)
    for name, lock_id, value, hex_value, slots in rows:
        h = lock_hash(name, int(lock_id))
        assert (h, h & 0xFFFFFFFF) == (int(value), int(hex_value, 16))
        assert lock_slots(h, 30000) == tuple(int(s) for s in slots.split(","))
        assert ((name, int(lock_id)), h) in GOLDEN_HASHES


def test_lock_hash_distinguishes_name_and_id():
    assert lock_hash("account", 1) != lock_hash("account", 2)
    assert lock_hash("account", 1) != lock_hash("withdrawal", 1)


@pytest.mark.parametrize("name, lock_id, error", [("a", 2 ** 63, ValueError), ("a", -2 ** 63 - 1, ValueError),
                                                  (b"a", 1, TypeError)])
def test_lock_hash_rejects_what_the_wire_cannot_carry(name, lock_id, error):
    with pytest.raises(error):
        lock_hash(name, lock_id)


def test_slots_follow_the_lcg():
    # h = 820683174; h = h * 1103515245 + 12345 (mod 2**32), three times; slot = (h & 0x3FFFFFFF) % 30000
    assert lock_slots(820683174, 30000) == (18567, 9716, 6605)
    h, expected = -5 & 0xFFFFFFFF, []
    for _ in range(NUM_HASH_FUNCTIONS):
        h = (h * 1103515245 + 12345) % 2 ** 32
        expected.append((h & 0x3FFFFFFF) % 97)
    assert lock_slots(-5, 97) == tuple(expected)
    assert all(0 <= s < 7 for h in range(-50, 50) for s in lock_slots(h, 7))


# -- the table --------------------------------------------------------------------------------

def test_slots_start_at_the_high_water_mark_and_requests_without_checked_locks_pass():
    table = LockTable(size=100, high_water_mark=41)
    assert table.lock_estimate(7) == 41
    assert table.check(LockRequest(), -1) == LockCheck(LockOutcome.GRANTED, -1)
    assert table.check(LockRequest(append_locks=[7]), -1) == LockCheck(LockOutcome.GRANTED, -1)
    assert table.check(LockRequest(write_locks=[7]), 41).outcome is LockOutcome.GRANTED
    # Strictly greater fails: a client at 40 has not seen transaction 41.
    assert table.check(LockRequest(write_locks=[7]), 40) == LockCheck(LockOutcome.FAILED, 41)


def commit(table, request, txn):
    table.commit(table.begin(request), txn)


def test_write_locks_are_checked_and_updated():
    table = LockTable(size=30000, high_water_mark=-1)
    a = lock_hash("account", 1)
    commit(table, LockRequest(write_locks=[a]), 5)
    assert table.check(LockRequest(write_locks=[a]), 4) == LockCheck(LockOutcome.FAILED, 5)
    assert table.check(LockRequest(write_locks=[a]), 5).outcome is LockOutcome.GRANTED
    assert table.check(LockRequest(write_locks=[lock_hash("account", 2)]), -1).outcome is LockOutcome.GRANTED


def test_read_locks_are_checked_but_never_updated():
    table = LockTable(high_water_mark=-1)
    a = lock_hash("account", 1)
    commit(table, LockRequest(read_locks=[a]), 9)
    assert table.lock_estimate(a) == -1
    commit(table, LockRequest(write_locks=[a]), 10)
    assert table.check(LockRequest(read_locks=[a]), 9) == LockCheck(LockOutcome.FAILED, 10)
    assert table.check(LockRequest(read_locks=[a]), 10).outcome is LockOutcome.GRANTED


def test_append_locks_are_updated_but_never_checked():
    table = LockTable(high_water_mark=-1)
    parent = lock_hash("ledger", 1)
    commit(table, LockRequest(append_locks=[parent]), 3)
    commit(table, LockRequest(append_locks=[parent]), 4)   # appenders do not conflict with each other
    assert table.check(LockRequest(append_locks=[parent]), -1).outcome is LockOutcome.GRANTED
    # ... but a reader or writer of the same lock sees them.
    assert table.check(LockRequest(read_locks=[parent]), 3) == LockCheck(LockOutcome.FAILED, 4)
    assert table.check(LockRequest(write_locks=[parent]), 3) == LockCheck(LockOutcome.FAILED, 4)


def test_request_estimate_is_the_max_over_locks_of_the_min_over_slots():
    table = LockTable(size=1000, high_water_mark=0)
    a, b = 11, 12
    commit(table, LockRequest(write_locks=[a]), 7)
    commit(table, LockRequest(write_locks=[b]), 3)
    assert table.estimate(LockRequest(write_locks=[a], read_locks=[b])) == 7
    assert table.estimate(LockRequest(read_locks=[b])) == 3


def colliding_hash(table, victim, avoid=()):
    """A hash sharing at least one slot with ``victim`` but not all of them."""
    target = set(table.slots(victim))
    for h in range(1, 10 ** 6):
        slots = set(table.slots(h))
        if h != victim and slots & target and not target <= slots and not slots & set(avoid):
            return h
    raise AssertionError("no collision found")


def test_a_shared_slot_is_not_a_failure_while_another_slot_is_low():
    table = LockTable(size=50, high_water_mark=-1)
    a = 1234
    b = colliding_hash(table, a)
    commit(table, LockRequest(write_locks=[b]), 8)
    # a's minimum is still over a slot b did not touch.
    assert table.lock_estimate(a) == -1
    assert table.check(LockRequest(write_locks=[a]), -1).outcome is LockOutcome.GRANTED


def test_a_full_collision_is_a_false_positive_never_a_false_negative():
    table = LockTable(size=3, high_water_mark=-1)
    # With 3 slots, find two hashes with the same slot set.
    a = 1
    b = next(h for h in range(2, 10 ** 5) if set(table.slots(h)) == set(table.slots(a)))
    commit(table, LockRequest(write_locks=[b]), 6)
    assert table.check(LockRequest(write_locks=[a]), 5) == LockCheck(LockOutcome.FAILED, 6)


def test_in_flight_updates_hold_back_checked_locks_until_they_settle():
    table = LockTable(size=30000, high_water_mark=-1)
    a, other = lock_hash("account", 1), lock_hash("account", 2)
    held = table.begin(LockRequest(write_locks=[a]))
    assert table.check(LockRequest(write_locks=[a]), 10).outcome is LockOutcome.IN_FLIGHT
    assert table.check(LockRequest(read_locks=[a]), 10).outcome is LockOutcome.IN_FLIGHT
    assert table.check(LockRequest(append_locks=[a]), 10).outcome is LockOutcome.GRANTED
    assert table.check(LockRequest(write_locks=[other]), 10).outcome is LockOutcome.GRANTED
    table.commit(held, 11)
    assert table.held == 0
    assert table.check(LockRequest(write_locks=[a]), 10) == LockCheck(LockOutcome.FAILED, 11)


def test_an_append_lock_in_flight_holds_back_readers_and_a_failed_append_releases_without_raising():
    table = LockTable(high_water_mark=-1)
    a = lock_hash("ledger", 9)
    first = table.begin(LockRequest(append_locks=[a]))
    second = table.begin(LockRequest(append_locks=[a]))
    assert table.check(LockRequest(read_locks=[a]), 0).outcome is LockOutcome.IN_FLIGHT
    table.release(first)
    assert table.check(LockRequest(read_locks=[a]), 0).outcome is LockOutcome.IN_FLIGHT
    table.release(second)
    assert table.check(LockRequest(read_locks=[a]), -1) == LockCheck(LockOutcome.GRANTED, -1)


def test_reset_raises_every_slot():
    table = LockTable(size=10, high_water_mark=-1)
    commit(table, LockRequest(write_locks=[5]), 30)
    table.reset(20)
    assert table.lock_estimate(5) == 30
    assert table.lock_estimate(6) == 20
    assert table.check(LockRequest(write_locks=[6], read_locks=[5]), 29) == LockCheck(LockOutcome.FAILED, 30)
    assert table.check(LockRequest(read_locks=[6]), 19) == LockCheck(LockOutcome.FAILED, 20)
    assert table.check(LockRequest(), 19) == LockCheck(LockOutcome.GRANTED, -1)
    table.reset(10)     # never lowers a slot
    assert table.lock_estimate(6) == 20
    commit(table, LockRequest(append_locks=[6]), 40)
    assert table.lock_estimate(6) == 40


def test_a_reset_of_the_largest_table_does_not_stall_the_reactor():
    # reset() runs on the reactor thread when a store reports commits the partition did not make; rewriting
    # every slot of the largest table the config accepts took most of a second.
    from waltz.server.config import MAX_LOCK_TABLE_SIZE
    table = LockTable(size=MAX_LOCK_TABLE_SIZE, high_water_mark=-1)
    started = time.perf_counter()
    for mark in range(100):
        table.reset(mark)
    assert time.perf_counter() - started < 0.1
    assert table.lock_estimate(12345) == 99


def test_lock_request_of_an_append_request():
    request = AppendRequest.create(ReqId(1, 1, 0, 1), 5, 0, b"x", write_locks=[1], read_locks=[2],
                                   append_locks=[3])
    assert LockRequest.of(request) == LockRequest((1,), (2,), (3,))
    assert LockRequest.of(request).checked == (1, 2)
    assert LockRequest.of(request).updated == (1, 3)


def test_table_size_must_be_positive():
    with pytest.raises(ValueError):
        LockTable(size=0)


# -- no false negatives -----------------------------------------------------------------------

LOCK_IDS = st.integers(0, 11)
REQUESTS = st.tuples(st.lists(LOCK_IDS, max_size=3), st.lists(LOCK_IDS, max_size=3),
                     st.lists(LOCK_IDS, max_size=2), st.integers(0, 4))
# Each step: submit a request (locks by id, and how far behind the head its client is),
# or settle the oldest in-flight request (commit or fail).
STEPS = st.lists(st.one_of(st.tuples(st.just("submit"), REQUESTS),
                           st.tuples(st.just("settle"), st.booleans())), max_size=60)


class Pipeline:
    """An append pipeline over the table, with the truth about which lock ids each commit wrote."""

    def __init__(self, table_size):
        self.table = LockTable(size=table_size, high_water_mark=-1)
        self.hwm = -1
        self.writers = {}          # lock id -> transaction ids that updated it
        self.in_flight = []        # (locks, held)
        self.waiting = []          # requests held back by in-flight conflicts, in order

    @staticmethod
    def hashes(ids):
        return [lock_hash("lock", i) for i in ids]

    def submit(self, request):
        self.waiting.append(request)
        self.run()

    def run(self):
        while self.waiting:
            write, read, append, behind = self.waiting[0]
            client_hwm = max(-1, self.hwm - behind)
            request = LockRequest(self.hashes(write), self.hashes(read), self.hashes(append))
            check = self.table.check(request, client_hwm)
            if check.outcome is LockOutcome.IN_FLIGHT:
                assert self.in_flight, "an in-flight conflict with nothing in flight"
                return
            self.waiting.pop(0)
            truly_stale = any(t > client_hwm for i in write + read for t in self.writers.get(i, ()))
            if truly_stale:
                assert check.outcome is LockOutcome.FAILED, "false negative"
            assert check.estimate >= max((max(self.writers.get(i, [-1])) for i in write + read), default=-1)
            if check.outcome is LockOutcome.GRANTED:
                self.in_flight.append(((write, read, append, client_hwm), self.table.begin(request)))

    def settle(self, commits):
        if not self.in_flight:
            return
        (write, read, append, client_hwm), held = self.in_flight.pop(0)
        if commits:
            self.hwm += 1
            # Serializability: nothing committed after what the client saw touched its checked locks.
            assert not any(t > client_hwm for i in write + read for t in self.writers.get(i, ()))
            self.table.commit(held, self.hwm)
            for i in set(write + append):
                self.writers.setdefault(i, []).append(self.hwm)
        else:
            self.table.release(held)
        self.run()


def run_pipeline(table_size, steps):
    pipeline = Pipeline(table_size)
    for kind, arg in steps:
        if kind == "submit":
            pipeline.submit(arg)
        else:
            pipeline.settle(arg)
    while pipeline.in_flight:
        pipeline.settle(True)
    assert not pipeline.waiting and pipeline.table.held == 0


@pytest.mark.parametrize("table_size", [1, 7, 30000])
def test_no_false_negatives_over_random_lock_sets(table_size):
    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(STEPS)
    def run(steps):
        run_pipeline(table_size, steps)

    run()


def test_the_server_checks_an_append_request_itself_as_its_lock_request():
    # The server partition hands the decoded AppendRequest to the table (no LockRequest per append): the
    # table reads only its three lock tuples, and decides exactly as for the LockRequest of the same locks.
    by_request, by_locks = LockTable(64), LockTable(64)
    writer = AppendRequest.create(ReqId(1, 1, 0, 1), -1, 0, b"w", write_locks=(11, 12), append_locks=(13,))
    for table, request in ((by_request, writer), (by_locks, LockRequest.of(writer))):
        table.commit(table.begin(request), 5)
    reader = AppendRequest.create(ReqId(2, 1, 0, 1), 4, 0, b"r", read_locks=(12,), write_locks=(20,))
    assert by_request.check(reader, 4) == by_locks.check(LockRequest.of(reader), 4) == LockCheck(LockOutcome.FAILED, 5)
    appender = AppendRequest.create(ReqId(3, 1, 0, 1), 4, 0, b"a", read_locks=(13,))
    assert by_request.check(appender, 4) == LockCheck(LockOutcome.FAILED, 5)   # append locks raise their slots
    held = by_request.begin(reader)
    assert by_request.check(AppendRequest.create(ReqId(4, 1, 0, 1), 5, 0, b"x", write_locks=(20,)), 5).outcome \
        is LockOutcome.IN_FLIGHT
    by_request.release(held)
    assert by_request.held == 0 and by_locks.held == 0


def test_the_estimate_reads_the_slots_lock_slots_names():
    # _estimate computes the slots inline (lock_slots is the definition): both must agree for every hash, or
    # commits would raise slots the checks never read.
    rng = random.Random(5)
    table = LockTable(997)
    table._marks = [rng.randrange(-1, 10_000) for _ in range(997)]
    for h in [rng.randint(-2 ** 31, 2 ** 31 - 1) for _ in range(2000)] + [0, -1, 2 ** 31 - 1, -2 ** 31]:
        assert table.lock_estimate(h) == min(table._marks[s] for s in lock_slots(h, 997)), h
