"""Reading from whichever replica serves a read: what counts as an answer, and failing over."""

import pytest
from twisted.internet import defer

from tests.server.store.test_store_session import DummyReplica, records
from waltz.protocols.values import Record
from waltz.recovery.replica_reads import (
    HEADERS, RECORDS, NoReplicaCouldRead, ReplicaReadError, check_answer, read_from_any)


def replica(storage, log, error=None):
    r = DummyReplica(storage, 1, list(log))
    r.read_error = error
    return r


def rotten(record):
    return Record(record.transaction_id, record.req_id, record.header, b"bit rot", record.checksum)


def test_an_answer_is_the_records_asked_for_in_order_and_intact():
    got = records(3, 3)
    assert check_answer(got, 3, 5, True) == tuple(got)                 # short is fine: the caller asks again
    assert check_answer([r.record_header for r in got], 3, 3, False) == tuple(r.record_header for r in got)
    for answer, first, count, why in [
            ([], 3, 5, "no records from committed transaction 3"),
            (got, 3, 2, "3 records for a read of 2"),
            (got, 2, 5, "transaction 3 where 2 was expected"),
            ([got[0], got[2]], 3, 5, "transaction 5 where 4 was expected"),
            ([got[0], rotten(got[1])], 3, 5, "transaction 4 failed its data checksum")]:
        with pytest.raises(ReplicaReadError, match=why):
            check_answer(answer, first, count, True)


def test_headers_are_not_checked_for_data():
    header = rotten(records(0, 1)[0]).record_header
    assert check_answer([header], 0, 1, False) == (header,)


def test_the_first_replica_that_answers_serves_the_read_and_failures_are_reported_in_order():
    log = records(0, 4)
    a = replica("a:1", log, OSError("I/O error"))
    b = replica("b:1", log[:1] + [rotten(log[1])] + log[2:])
    c = replica("c:1", log)
    failed = []
    d = read_from_any([a, b, c], RECORDS, 0, 4, lambda r, f: failed.append((r, f.getErrorMessage())))
    assert [r.transaction_id for r in d.result] == [0, 1, 2, 3]
    assert failed == [(a, "I/O error"), (b, "transaction 1 failed its data checksum")]
    assert [call for call in c.calls if call[0] == "get_records"] == [("get_records", 0)]


def test_a_replica_without_the_records_is_passed_over():
    log = records(0, 4)
    d = read_from_any([replica("a:1", log[:2]), replica("b:1", log)], HEADERS, 2, 2)
    assert [h.transaction_id for h in d.result] == [2, 3]


def test_when_no_replica_serves_the_read_the_error_names_each_one_and_why():
    log = records(0, 2)
    d = read_from_any([replica("a:1", log, OSError("I/O error")), replica("b:1", [])], RECORDS, 0, 2)
    failure = d.result
    d.addErrback(lambda f: None)
    assert isinstance(failure.value, NoReplicaCouldRead)
    assert str(failure.value) == ("reading 2 transaction(s) from 0: storage a:1: I/O error; "
                                  "storage b:1: no records from committed transaction 0 on")


def test_no_candidates_is_a_failed_read():
    d = read_from_any([], RECORDS, 0, 1)
    failure = d.result
    d.addErrback(lambda f: None)
    assert isinstance(failure.value, NoReplicaCouldRead) and "no replica to read from" in str(failure.value)


def test_a_replica_answering_later_is_waited_for_before_the_next_is_asked():
    log = records(0, 1)
    slow = replica("a:1", log)
    pending = defer.Deferred()
    slow.get_records = lambda first, count: pending
    b = replica("b:1", log)
    d = read_from_any([slow, b], RECORDS, 0, 1)
    assert not d.called and not b.calls
    pending.errback(ConnectionError("connection lost"))
    assert [r.transaction_id for r in d.result] == [0]
