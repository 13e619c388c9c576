"""Every storage and admin request against a storage node over real loopback sockets.

The node, its handlers and the client protocols are the real ones; the node
runs in the test's reactor so failures are easy to inspect. The same requests
against the ``twistd waltz-storage`` daemon are in tests/integration.
"""

import json
import threading
import os
import uuid

import pytest
import pytest_twisted
from twisted.internet import defer, endpoints, reactor, threads

from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.protocols.rpc import AdminClientProtocol, RemoteError, RequestClientFactory, StorageClientProtocol
from waltz.protocols.values import Record, ReqId
from waltz.storage import node as node_module
from waltz.storage import segment as segment_module
from waltz.storage.controlfile import CONTROL_FILE_NAME, HEADER_SIZE, PARTITION_INFO_SIZE
from waltz.storage.handlers import AdminServerProtocol, NodeFactory, StorageServerProtocol
from waltz.storage.node import StorageNode

KEY = uuid.UUID("8c9f4f3e-0d3b-4f55-9b86-0d7c2c1b5e11")
PARTITIONS = 3


def records(first, count, partition=0, size=100):
    return tuple(Record.create(t, ReqId(1, 1, partition, t), t % 7, bytes([t % 251]) * size)
                 for t in range(first, first + count))


class Harness:
    def __init__(self, directory):
        self.node = StorageNode(directory, reactor, segment_size_threshold=4096)
        self.ports = []
        self.clients = []

    @defer.inlineCallbacks
    def start(self):
        yield self.node.open(KEY, PARTITIONS)
        for cls in (StorageServerProtocol, AdminServerProtocol):
            endpoint = endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
            self.ports.append((yield endpoint.listen(NodeFactory(cls, self.node))))

    @defer.inlineCallbacks
    def connect(self, admin=False, key=KEY, partitions=PARTITIONS):
        cls, open_cls, port = ((AdminClientProtocol, am.OpenRequest, self.ports[1]) if admin
                               else (StorageClientProtocol, sm.OpenRequest, self.ports[0]))
        open_request = (am.OpenRequest(-1, key, partitions) if admin
                        else sm.OpenRequest.create(key, partitions))
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        proto = yield endpoint.connect(RequestClientFactory(cls, open_request))
        self.clients.append(proto)
        return proto

    @defer.inlineCallbacks
    def stop(self):
        for proto in self.clients:
            proto.transport.loseConnection()
        for port in self.ports:
            yield port.stopListening()
        yield self.node.close()


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "storage"))
    pytest_twisted.blockon(h.start())
    yield h
    pytest_twisted.blockon(h.stop())


def failing_datasync(fd):
    """An fdatasync that reports a writeback error."""
    raise OSError(5, "Input/output error")


def failure_text(exc_info):
    return exc_info.value.info.message


async def assign(harness, *pids):
    admin = await harness.connect(admin=True)
    await admin.request(am.PartitionAssignmentRequest(0, pids, True, False))
    return admin


@pytest_twisted.ensureDeferred
async def test_open_with_wrong_key_or_partition_count_names_both_values(harness):
    other = uuid.UUID(int=1)
    proto = await harness.connect(key=other)
    with pytest.raises(RemoteError) as exc:
        await proto.opened
    assert str(KEY) in failure_text(exc) and str(other) in failure_text(exc)
    proto = await harness.connect(partitions=5)
    with pytest.raises(RemoteError, match="3 partitions.*names 5"):
        await proto.opened


@pytest_twisted.ensureDeferred
async def test_a_directory_that_cannot_be_made_is_reported_naming_the_config_key(tmp_path):
    from waltz.config import ConfigError
    blocker = tmp_path / "file"
    blocker.write_text("x")
    node = StorageNode(str(blocker / "data"), reactor)      # its parent is a file
    with pytest.raises(ConfigError, match="config key 'storage.directory': cannot use .*file/data: "):
        await node.open(KEY, PARTITIONS)


@pytest_twisted.ensureDeferred
async def test_append_read_truncate_and_session_info_round_trip(harness):
    await assign(harness, 0)
    s = await harness.connect()
    info = await s.request(sm.LastSessionInfoRequest(1, 0, 0, False))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (-1, -1, -1)
    batch = records(0, 20)
    assert isinstance(await s.request(sm.AppendRequest(1, 0, 0, batch, False)), sm.SuccessResponse)
    assert isinstance(await s.request(sm.AppendRequest(1, 0, 0, records(20, 30), False)), sm.SuccessResponse)
    assert (await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == 49
    assert (await s.request(sm.RecordRequest(1, 0, 0, 7))).record == batch[7]
    assert (await s.request(sm.RecordHeaderRequest(1, 0, 0, 7))).record_header == batch[7].record_header
    assert (await s.request(sm.RecordRequest(1, 0, 0, 50))).record is None
    listed = await s.request(sm.RecordListRequest(1, 0, 0, 15, 10))
    assert listed.records == records(0, 50)[15:25]
    headers = await s.request(sm.RecordHeaderListRequest(1, 0, 0, 45, 100))
    assert [h.transaction_id for h in headers.record_headers] == [45, 46, 47, 48, 49]
    truncated = await s.request(sm.TruncateRequest(1, 0, 0, 29, False))
    assert isinstance(truncated, sm.MaxTransactionIdResponse) and truncated.transaction_id == 29
    await s.request(sm.SetLowWaterMarkRequest(1, 0, 0, 29, False))
    info = await s.request(sm.LastSessionInfoRequest(2, 0, 0, False))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (1, 29, 29)


@pytest_twisted.ensureDeferred
async def test_bad_appends_get_failures_and_change_nothing(harness):
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 5), False))
    with pytest.raises(RemoteError, match="(?i)sequence|expected"):
        await s.request(sm.AppendRequest(1, 0, 0, records(6, 2), False))  # gap
    bad = records(5, 2)
    corrupt = (bad[0], Record(6, bad[1].req_id, 0, b"x" * 100, bad[1].checksum))
    with pytest.raises(RemoteError, match="(?i)checksum"):
        await s.request(sm.AppendRequest(1, 0, 0, corrupt, False))
    with pytest.raises(RemoteError, match="cannot set low-water mark 3"):
        await s.request(sm.SetLowWaterMarkRequest(1, 0, 0, 3, False))
    assert (await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == 4
    listed = await s.request(sm.RecordListRequest(1, 0, 0, 0, 10))
    assert listed.records == records(0, 5)
    assert s.connected


@pytest_twisted.ensureDeferred
async def test_missing_and_unassigned_partitions_are_refused(harness):
    await assign(harness, 0)
    s = await harness.connect()
    with pytest.raises(RemoteError, match="partition 9 does not exist"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 9, False))
    with pytest.raises(RemoteError, match="partition 1 is not assigned"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 1, False))
    assert (await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == -1


@pytest_twisted.ensureDeferred
async def test_session_fencing(harness):
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(5, 0, 0, records(0, 1), False))
    with pytest.raises(RemoteError, match="session 4 is fenced"):
        await s.request(sm.AppendRequest(4, 0, 0, records(1, 1), False))
    await s.request(sm.AppendRequest(6, 0, 0, records(1, 1), False))
    with pytest.raises(RemoteError, match="session 5 is fenced"):
        await s.request(sm.RecordRequest(5, 0, 0, 0))


@pytest_twisted.ensureDeferred
async def test_admin_toggles_availability_reads_and_writes(harness):
    admin = await assign(harness, 0, 1)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 3), False))
    await admin.request(am.PartitionWriteRequest(0, (0,), False))
    with pytest.raises(RemoteError, match="not writable"):
        await s.request(sm.AppendRequest(1, 0, 0, records(3, 1), False))
    assert (await s.request(sm.RecordRequest(1, 0, 0, 2))).record is not None
    await admin.request(am.PartitionReadRequest(0, (0,), False))
    with pytest.raises(RemoteError, match="not readable"):
        await s.request(sm.RecordRequest(1, 0, 0, 2))
    await admin.request(am.PartitionReadRequest(0, (0,), True))
    await admin.request(am.PartitionWriteRequest(0, (0,), True))
    await s.request(sm.AppendRequest(1, 0, 0, records(3, 1), False))
    await admin.request(am.PartitionAvailableRequest(0, (0,), False))
    with pytest.raises(RemoteError, match="not available"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))
    offline = await s.request(sm.MaxTransactionIdRequest(1, 0, 0, True))
    assert offline.transaction_id == 3
    status = await admin.request(am.AssignedPartitionStatusRequest(0))
    assert status.partition_status == ((0, False), (1, True))


@pytest_twisted.ensureDeferred
async def test_admin_record_list_session_info_metrics_and_unassign(harness, tmp_path):
    admin = await assign(harness, 2)
    s = await harness.connect()
    await s.request(sm.AppendRequest(3, 0, 2, records(0, 4, partition=2), False))
    await s.request(sm.SetLowWaterMarkRequest(3, 0, 2, 3, False))
    listed = await admin.request(am.RecordListRequest(0, 2, 1, 2))
    assert listed.partition_id == 2 and listed.records == records(0, 4, partition=2)[1:3]
    info = await admin.request(am.LastSessionInfoRequest(0, 2))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (3, 3, 3)
    metrics = json.loads((await admin.request(am.MetricsRequest(0))).metrics_json)
    assert metrics["waltz_storage_appended_records_total"]['{partition="2"}'] == 4
    assert os.path.isdir(tmp_path / "storage" / "2")
    await admin.request(am.PartitionAssignmentRequest(0, (2,), False, True))
    assert not os.path.exists(tmp_path / "storage" / "2")
    with pytest.raises(RemoteError, match="not assigned"):
        await s.request(sm.MaxTransactionIdRequest(3, 0, 2, False))
    assert (await admin.request(am.AssignedPartitionStatusRequest(0))).partition_status == ()


@pytest_twisted.ensureDeferred
async def test_request_before_open_closes_only_that_connection(harness):
    await assign(harness, 0)
    good = await harness.connect()
    port = harness.ports[0].getHost().port
    bad = await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(
        RequestClientFactory(StorageClientProtocol, sm.MaxTransactionIdRequest(1, -1, 0, False)))
    with pytest.raises(Exception):
        await bad.opened
    assert (await good.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == -1


@pytest_twisted.ensureDeferred
async def test_a_failed_fdatasync_fails_the_partition_for_good_and_says_so(harness, monkeypatch):
    await assign(harness, 0, 1)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 3), False))

    monkeypatch.setattr(segment_module, "datasync", failing_datasync)
    with pytest.raises(RemoteError, match="Input/output error"):
        await s.request(sm.AppendRequest(1, 0, 0, records(3, 2), False))
    monkeypatch.undo()                   # the disk "works" again: the partition must not believe it
    with pytest.raises(RemoteError, match="failed earlier"):
        await s.request(sm.AppendRequest(1, 0, 0, records(3, 2), False))
    problem = harness.node.partitions[0].problem
    assert "restart the storage node" in problem and "Input/output error" in problem
    assert harness.node.assigned_status() == ((0, False), (1, True))


def files_open_under(path):
    """How many of this process's file descriptors are open on files under ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink("/proc/self/fd/" + fd).startswith(path)
        except OSError:
            pass
    return count


@pytest_twisted.ensureDeferred
async def test_closing_a_partition_whose_sync_failed_closes_its_files(harness, monkeypatch):
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 3), False))
    partition_dir = os.path.join(harness.node.directory, "0")
    assert files_open_under(partition_dir) > 0
    monkeypatch.setattr(segment_module, "datasync", failing_datasync)
    with pytest.raises(RemoteError, match="Input/output error"):
        await s.request(sm.AppendRequest(1, 0, 0, records(3, 2), False))
    monkeypatch.undo()
    await harness.node.assign([0], False)
    assert files_open_under(partition_dir) == 0


@pytest_twisted.ensureDeferred
async def test_a_sync_failing_inside_an_append_stops_the_partition_reporting_its_end(harness, monkeypatch):
    # The sync that fails is the one before a segment roll, inside the append: the records written
    # before it may not be on disk, so the partition must not report them (recovery takes the max
    # transaction id as a vote about durable data), and it must say it failed.
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 20), False))

    monkeypatch.setattr(segment_module, "datasync", failing_datasync)
    with pytest.raises(RemoteError, match="Input/output error"):
        await s.request(sm.AppendRequest(1, 0, 0, records(20, 30), False))    # rolls a segment on the way
    monkeypatch.undo()
    with pytest.raises(RemoteError, match="restart the storage node"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))
    problem = harness.node.partitions[0].problem
    assert problem is not None and "restart the storage node" in problem and "Input/output error" in problem
    assert harness.node.assigned_status() == ((0, False),)


async def stopped_with_five_records(directory):
    """A storage node in ``directory`` that stored transactions 0..4 of partition 0, then stopped."""
    first = Harness(directory)
    await first.start()
    await assign(first, 0)
    s = await first.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 5), False))
    await first.stop()


@pytest_twisted.ensureDeferred
async def test_unassigning_with_delete_repairs_a_corrupted_control_record(tmp_path):
    directory = str(tmp_path / "storage")
    await stopped_with_five_records(directory)
    path = os.path.join(directory, CONTROL_FILE_NAME)
    with open(path, "r+b") as f:                # both structs of partition 0 unreadable
        f.seek(HEADER_SIZE + 4)
        f.write(b"\xff" * (PARTITION_INFO_SIZE - 4))
    second = Harness(directory)
    await second.start()
    try:
        assert "failed to open" in second.node.partitions[0].problem
        admin = await second.connect(admin=True)
        await admin.request(am.PartitionAssignmentRequest(0, (0,), False, True))     # unassign, delete files
        assert not os.path.exists(os.path.join(directory, "0"))
        assert second.node.control.partition_info(0).session_id == -1
        assert (await admin.request(am.AssignedPartitionStatusRequest(0))).partition_status == ()
    finally:
        await second.stop()


async def node_with_five_records(tmp_path, low_water_mark=None):
    """The directory of a stopped storage node whose partition 0 holds records 0..4 (session 5)."""
    directory = str(tmp_path / "storage")
    first = Harness(directory)
    await first.start()
    await assign(first, 0)
    s = await first.connect()
    await s.request(sm.AppendRequest(5, 0, 0, records(0, 5), False))
    if low_water_mark is not None:
        await s.request(sm.SetLowWaterMarkRequest(5, 1, 0, low_water_mark, False))
    await first.stop()
    return directory


@pytest_twisted.ensureDeferred
async def test_a_partition_whose_log_fails_to_open_reports_its_recorded_session(tmp_path):
    # Its control record is sound: the admin port answered -1 for session and marks (so tools sent session -1).
    directory = await node_with_five_records(tmp_path, low_water_mark=4)
    with open(os.path.join(directory, "0", "%019d.seg" % 0), "r+b") as f:   # damage record 4, a trusted one
        f.seek(128 + 4 * 140 + 40)
        f.write(b"\x00\x01")
    second = Harness(directory)
    await second.start()
    try:
        assert "failed to open" in second.node.partitions[0].problem
        admin = await second.connect(admin=True)
        info = await admin.request(am.LastSessionInfoRequest(0, 0))
        recorded = second.node.control.partition_info(0)
        assert recorded.session_id == 5
        assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == \
            (recorded.session_id, recorded.low_water_mark, recorded.local_low_water_mark)
    finally:
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_opening_a_partition_logs_what_its_recovery_cut(tmp_path):
    # A cut left no trace: an operator looking for a replica shorter than expected found nothing in its log.
    from twisted.logger import globalLogPublisher
    directory = await node_with_five_records(tmp_path)
    with open(os.path.join(directory, "0", "%019d.seg" % 0), "ab") as f:   # the torn start of record 5
        f.write(b"\x00" * 7 + b"\x05" + b"\x00" * 10)
    seen = []
    globalLogPublisher.addObserver(seen.append)
    second = Harness(directory)
    try:
        await second.start()
    finally:
        globalLogPublisher.removeObserver(seen.append)
    try:
        assert second.node.partitions[0].log.max_transaction_id == 4
        [cut] = [e for e in seen if "recovery cut" in e.get("log_format", "")]
        assert (cut["pid"], cut["size"], cut["max"]) == (0, 18, 4) and "truncated record header" in cut["why"]
    finally:
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_a_truncation_below_the_local_low_water_mark_is_refused(harness):
    # Transactions up to it were committed, and recovery trusts the index up to it: cutting below it (no
    # recovery asks that) would lose them, and a later open would trust index entries never checked.
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(5, 0, 0, records(0, 5), False))
    await s.request(sm.SetLowWaterMarkRequest(5, 1, 0, 4, False))
    await s.request(sm.AppendRequest(5, 2, 0, records(5, 3), False))
    with pytest.raises(RemoteError, match="cannot truncate partition 0 to 3: transactions up to its local "
                                          "low-water mark 4 are committed"):
        await s.request(sm.TruncateRequest(5, 3, 0, 3, False))
    assert (await s.request(sm.MaxTransactionIdRequest(5, 4, 0, False))).transaction_id == 7
    assert (await s.request(sm.TruncateRequest(5, 5, 0, 4, False))).transaction_id == 4


@pytest_twisted.ensureDeferred
async def test_deleting_a_partition_resets_its_record_before_its_files_go(harness, monkeypatch):
    # A crash must never leave a record claiming the last session beside missing segments: the replica
    # would vote with an empty log. The files go after the record, and in one rename.
    await assign(harness, 0)
    s = await harness.connect()
    await s.request(sm.AppendRequest(1, 0, 0, records(0, 5), False))
    seen = []

    def deleting(storage_dir, pid):
        seen.append((harness.node.control.partition_info(pid).session_id,
                     os.path.isdir(os.path.join(storage_dir, str(pid)))))
        raise OSError("crash before the files are gone")
    monkeypatch.setattr(node_module, "delete_partition_directory", deleting)
    admin = await harness.connect(admin=True)
    with pytest.raises(RemoteError, match="crash before the files are gone"):
        await admin.request(am.PartitionAssignmentRequest(0, (0,), False, True))
    assert seen == [(-1, True)]                 # the record was reset while the segments were still there


@pytest_twisted.ensureDeferred
async def test_a_deletion_a_crash_interrupted_is_finished_at_start(tmp_path):
    directory = str(tmp_path / "storage")
    await stopped_with_five_records(directory)
    os.rename(os.path.join(directory, "0"), os.path.join(directory, "0.deleting"))   # crashed after the rename
    second = Harness(directory)
    await second.start()
    try:
        assert not os.path.exists(os.path.join(directory, "0.deleting"))
    finally:
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_health_names_a_control_file_whose_fdatasync_failed(harness, monkeypatch):
    from waltz.storage import controlfile as controlfile_module
    from waltz.storage.tap import StorageService
    service = StorageService.__new__(StorageService)     # only its health check, on the harness's node
    service.node = harness.node
    assert service.problems() == []

    monkeypatch.setattr(controlfile_module, "datasync", failing_datasync)
    admin = await harness.connect(admin=True)
    with pytest.raises(RemoteError, match="Input/output error"):
        await admin.request(am.PartitionAssignmentRequest(0, (0,), True, False))
    assert len(service.problems()) == 1 and "restart the storage node" in service.problems()[0]


@pytest_twisted.ensureDeferred
async def test_a_record_list_stops_short_of_the_frame_limit(harness):
    # 12 records of 2 MiB asked at once would be a 24 MiB answer: over the 16 MiB frame limit of the
    # server's storage connections, which would close, and the same read would close it again.
    await assign(harness, 0)
    s = await harness.connect()
    big = tuple(Record.create(t, ReqId(1, 1, 0, t), 0, bytes([t]) * (2 * 2 ** 20)) for t in range(12))
    for first in range(0, 12, 4):
        await s.request(sm.AppendRequest(1, 0, 0, big[first:first + 4], False))
    listed = (await s.request(sm.RecordListRequest(1, 0, 0, 0, 12))).records
    assert listed == big[:3]                   # 3 x 2 MiB fit in 8 MiB, a fourth would not
    assert (await s.request(sm.RecordListRequest(1, 0, 0, 3, 12))).records == big[3:6]


def _append(node, pid, session, first, count):
    return node.partition(pid).handle(sm.AppendRequest(session, 0, pid, records(first, count, pid), False))


@pytest_twisted.ensureDeferred
async def test_an_assign_waits_for_an_unassign_of_the_same_partition_still_draining(tmp_path):
    # Before: the assign opened a second log on the same files while the unassigned one still wrote the
    # appends it had acknowledged; the new log missed them (and overwrote them), and the unassign, ending
    # last, left the control record saying "not assigned" under a served partition.
    import time
    from twisted.internet import task
    from waltz.storage.controlfile import PartitionFlags
    node = StorageNode(str(tmp_path), reactor)
    await node.open(KEY, PARTITIONS)
    try:
        await node.assign([0], True)
        await _append(node, 0, 1, 0, 10)
        node.partition(0).worker.submit(time.sleep, 0.5)        # the disk thread is busy
        acked = _append(node, 0, 1, 10, 5)                       # admitted before the unassign
        unassign = node.assign([0], False)
        await task.deferLater(reactor, 0.05, lambda: None)
        await defer.gatherResults([acked, unassign, node.assign([0], True)])
        assert node.partition(0).log.max_transaction_id == 14
        assert node.control.partition_info(0).flags & PartitionFlags.ASSIGNED
    finally:
        await node.close()
    reopened = StorageNode(str(tmp_path), reactor)
    await reopened.open(KEY, PARTITIONS)
    try:
        assert reopened.partition(0).log.max_transaction_id == 14
    finally:
        await reopened.close()


@pytest_twisted.ensureDeferred
async def test_an_append_admitted_before_a_toggle_is_refused_when_its_turn_comes(tmp_path):
    # The flags were checked only on admission: an append admitted in the same turn as "unwritable" (or
    # "offline") was written after the admin tool had been told the toggle was done.
    from waltz.storage.controlfile import PartitionFlags
    from waltz.storage.partition import PartitionRefused
    node = StorageNode(str(tmp_path), reactor)
    await node.open(KEY, PARTITIONS)
    try:
        await node.assign([0, 1], True)
        toggled = node.set_flag([0], PartitionFlags.UNWRITABLE, True)
        offline = node.set_flag([1], PartitionFlags.AVAILABLE, False)
        refused_append = _append(node, 0, 1, 0, 1)
        refused_offline = _append(node, 1, 1, 0, 1)
        await defer.gatherResults([toggled, offline])
        with pytest.raises(PartitionRefused, match="partition 0 is not writable"):
            await refused_append
        with pytest.raises(PartitionRefused, match="partition 1 is not available"):
            await refused_offline
        assert node.partition(0).log.max_transaction_id == -1 and node.partition(1).log.max_transaction_id == -1
        assert node.assigned_status() == ((0, False), (1, False))     # not writable, not available
    finally:
        await node.close()


@pytest_twisted.ensureDeferred
async def test_a_log_left_unusable_by_a_truncation_is_reported_unhealthy(tmp_path):
    # The log refused every request ("restart the storage node") while /health and the admin status,
    # which waltz storage list and waltz cluster verify read, said it served.
    node = StorageNode(str(tmp_path), reactor, segment_size_threshold=4096)
    await node.open(KEY, PARTITIONS)
    try:
        await node.assign([0], True)
        await _append(node, 0, 1, 0, 100)
        partition = node.partition(0)
        first = os.path.join(str(tmp_path), "0", "%019d.seg" % partition.log.segment_ids[0])
        with open(first, "r+b") as stream:      # damage the reopen's header check finds
            stream.seek(28)
            stream.write(b"\x00\x00\x00\x07")
        with pytest.raises(Exception):
            await partition.handle(sm.TruncateRequest(1, 0, 0, 5, False))
        assert "its log is unusable: truncation to 5 could not reopen segment" in partition.problem
        assert node.assigned_status() == ((0, False),)
    finally:
        await node.close()


@pytest_twisted.ensureDeferred
async def test_append_metrics_are_updated_on_the_reactor_thread_once_the_append_is_durable(harness, monkeypatch):
    # Metrics take no lock (waltz.metrics): an update from a partition's disk thread could race the reactor
    # reading them for /metrics. The append's figures are counted on the reactor, after its fdatasync.
    threads, appended = [], harness.node.metrics.appended

    def recording(partition_id, appended_records, *rest):
        threads.append(threading.current_thread().name)
        appended(partition_id, appended_records, *rest)
    monkeypatch.setattr(harness.node.metrics, "appended", recording)
    await assign(harness, 1)
    s = await harness.connect()
    await s.request(sm.AppendRequest(3, 0, 1, records(0, 5, partition=1), False))
    assert threads == [threading.current_thread().name] and not threads[0].startswith("waltz-disk")
    assert harness.node.metrics.records.value(1) == 5
    assert harness.node.metrics.append_batch.count(1) == 1


# --- the durable session fence (docs/replication.md, "Fencing") ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_offline_tools_still_ask_in_the_recorded_session_after_a_newer_session_was_fenced(tmp_path):
    # Session 6's recovery asked this replica for its vote (fence 6; its control record still names 5), then the
    # operator marked the partition offline and restarted the node. `waltz storage max-transaction-id --offline`
    # asks in the admin port's last session, 5: it was refused for good, since an offline partition never lets
    # session 6 set its marks. A request that changes something is still refused in that session.
    directory = str(tmp_path / "storage")
    first = Harness(directory)
    await first.start()
    try:
        admin = await assign(first, 0)
        s = await first.connect()
        await s.request(sm.SetLowWaterMarkRequest(5, 0, 0, -1, False))
        await s.request(sm.LastSessionInfoRequest(6, 0, 0, False))
        await admin.request(am.PartitionAvailableRequest(0, (0,), False))
    finally:
        await first.stop()
    second = Harness(directory)
    await second.start()
    try:
        admin = await second.connect(admin=True)
        assert (await admin.request(am.LastSessionInfoRequest(0, 0))).last_session_id == 5
        s = await second.connect()
        assert (await s.request(sm.MaxTransactionIdRequest(5, 0, 0, True))).transaction_id == -1
        assert (await s.request(sm.MaxTransactionIdRequest(6, 0, 0, True))).transaction_id == -1
        with pytest.raises(RemoteError, match="offline request of session 5 refused: partition 0 is in session 6"):
            await s.request(sm.TruncateRequest(5, 0, 0, -1, True))
        with pytest.raises(RemoteError, match="offline request of session 4 refused"):
            await s.request(sm.MaxTransactionIdRequest(4, 0, 0, True))
    finally:
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_an_offline_request_is_answered_only_once_its_session_is_fenced(tmp_path):
    # A session-6 request admitted as the partition went offline was refused on the worker before any fence was
    # written, yet the partition was in session 6 in memory: an offline request of session 6 was then answered
    # with the durable fence still at -1.
    from waltz.storage.controlfile import PartitionFlags
    node = StorageNode(str(tmp_path), reactor)
    await node.open(KEY, PARTITIONS)
    try:
        await node.assign([0], True)
        offline = node.set_flag([0], PartitionFlags.AVAILABLE, False)
        refused = node.partition(0).handle(sm.LastSessionInfoRequest(6, 0, 0, False))
        await offline
        with pytest.raises(Exception, match="not available"):
            await refused
        await node.partition(0).handle(sm.MaxTransactionIdRequest(6, 0, 0, True))
        assert await threads.deferToThread(node.control.session_fence, 0) == 6
    finally:
        await node.close()


@pytest_twisted.ensureDeferred
async def test_fences_touch_the_control_file_only_off_the_reactor_and_survive_a_partition_s_deletion(
        tmp_path, monkeypatch):
    from waltz.storage import controlfile
    on_reactor = []
    for name in ("datasync", "pwrite_all", "pread_upto", "file_size"):
        def wrapper(*args, _original=getattr(controlfile, name), _name=name):
            if threading.current_thread() is threading.main_thread():
                on_reactor.append(_name)
            return _original(*args)
        monkeypatch.setattr(controlfile, name, wrapper)
    h = Harness(str(tmp_path / "storage"))
    await h.start()
    try:
        admin = await assign(h, 0, 1)
        s = await h.connect()
        for session in (3, 4, 5):
            await s.request(sm.LastSessionInfoRequest(session, 0, 0, False))
            await s.request(sm.LastSessionInfoRequest(session, 0, 1, False))
        await admin.request(am.LastSessionInfoRequest(0, 0))
        await admin.request(am.PartitionAssignmentRequest(0, (1,), False, True))    # unassigned, files deleted
        await admin.request(am.PartitionAssignmentRequest(0, (1,), True, False))
        with pytest.raises(RemoteError, match="session 4 is fenced"):
            await s.request(sm.AppendRequest(4, 0, 1, (), False))
    finally:
        await h.stop()
    assert on_reactor == []
