"""Partition permissions and session fencing of the storage (pure rules, no disk)."""

import pytest

from waltz.protocols import storage_messages as sm
from waltz.storage.controlfile import PartitionFlags, PartitionInfo
from waltz.storage.partition import OPERATIONS, Access, PartitionRefused, StoragePartition, check_permission

ASSIGNED = int(PartitionFlags.ASSIGNED | PartitionFlags.AVAILABLE)


def info(flags=ASSIGNED, session=5):
    return PartitionInfo(0, session_id=session, flags=int(flags))


def append(session=5, offline=False):
    return sm.AppendRequest(session, 1, 0, (), offline)


def read(session=5):
    return sm.RecordRequest(session, 1, 0, 3)


def test_every_storage_request_has_an_operation():
    requests = {sm.LastSessionInfoRequest, sm.MaxTransactionIdRequest, sm.SetLowWaterMarkRequest,
                sm.TruncateRequest, sm.AppendRequest, sm.RecordHeaderRequest, sm.RecordRequest,
                sm.RecordHeaderListRequest, sm.RecordListRequest}
    assert set(OPERATIONS) == requests
    assert [c for c, op in OPERATIONS.items() if op.is_write] == [sm.AppendRequest]


def test_unassigned_partition_refuses_everything():
    with pytest.raises(PartitionRefused, match="not assigned"):
        check_permission(info(PartitionFlags.AVAILABLE), 5, read(), Access.READ)


def test_unavailable_partition_accepts_only_offline_requests_of_its_session():
    unavailable = info(PartitionFlags.ASSIGNED)
    with pytest.raises(PartitionRefused, match="not available"):
        check_permission(unavailable, 5, append(), Access.WRITE)
    check_permission(unavailable, 5, append(offline=True), Access.WRITE)
    with pytest.raises(PartitionRefused, match="offline request of session 4"):
        check_permission(unavailable, 5, append(session=4, offline=True), Access.WRITE)


def test_available_partition_refuses_offline_requests():
    with pytest.raises(PartitionRefused, match="offline requests are refused"):
        check_permission(info(), 5, append(offline=True), Access.WRITE)


def test_read_and_write_toggles():
    unreadable = info(ASSIGNED | PartitionFlags.UNREADABLE)
    unwritable = info(ASSIGNED | PartitionFlags.UNWRITABLE)
    with pytest.raises(PartitionRefused, match="not readable"):
        check_permission(unreadable, 5, read(), Access.READ)
    check_permission(unreadable, 5, append(), Access.WRITE)
    with pytest.raises(PartitionRefused, match="not writable"):
        check_permission(unwritable, 5, append(), Access.WRITE)
    check_permission(unwritable, 5, read(), Access.READ)


class Worker:
    """Records the jobs (the operation's name, for a request: it runs through ``_permitted``)."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        if fn.__name__ == "_permitted":
            fn, args = args[0], args[2:]
        self.jobs.append((fn.__name__, args))

    submit_write = submit


def test_higher_session_is_adopted_and_lower_sessions_are_fenced():
    partition = StoragePartition(0, info(session=5), control=None, worker=Worker())
    partition.handle(read(session=7))
    assert partition.session_id == 7
    failed = partition.handle(read(session=6))
    errors = []
    failed.addErrback(lambda f: errors.append(f.value))
    assert isinstance(errors[0], PartitionRefused) and "session 6 is fenced" in str(errors[0])
    assert [name for name, _ in partition.worker.jobs] == ["_record"]
    partition.handle(read(session=7))
    assert len(partition.worker.jobs) == 2


def test_offline_request_does_not_adopt_a_session():
    partition = StoragePartition(0, info(PartitionFlags.ASSIGNED, session=5), control=None, worker=Worker())
    partition.handle(sm.MaxTransactionIdRequest(5, 1, 0, True))
    assert partition.session_id == 5 and len(partition.worker.jobs) == 1
