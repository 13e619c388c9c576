"""The ``twistd waltz-storage`` daemon as a real process: every request over loopback, HTTP,
kill -9 under load, bad configs and a corrupted control file.

ZooKeeper is the session's real server (tests/conftest.py); each test creates
its own cluster root and starts its own daemon (tests/integration/conftest.py),
stopped by pid when the test ends. The same requests against an in-process node
are in tests/storage/test_storage_node.py.
"""

import json
import os
import random
import signal
import subprocess
import uuid

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, threads
from twisted.python.failure import Failure

from tests.storage.test_storage_node import records
from waltz.local.ports import port_in_use
from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.protocols.rpc import ConnectionClosed, RemoteError
from waltz.protocols.values import Record, ReqId
from waltz.storage.controlfile import CONTROL_FILE_NAME, HEADER_SIZE, PARTITION_INFO_SIZE, STRUCT_SIZE

pytestmark = pytest.mark.integration


async def assign(clients, daemon, *partition_ids):
    """Assign partitions on ``daemon`` through its admin port; returns the admin connection."""
    admin = await clients.admin(daemon)
    response = await admin.request(am.PartitionAssignmentRequest(0, partition_ids, True, False))
    assert isinstance(response, am.SuccessResponse)
    return admin


# --- every request of both ports ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_every_storage_request_over_loopback(store_params, start_storage, storage_clients):
    daemon = start_storage()
    await assign(storage_clients, daemon, 0)
    s = await storage_clients.storage(daemon)
    info = await s.request(sm.LastSessionInfoRequest(1, 0, 0, False))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (-1, -1, -1)
    batch = records(0, 50)
    assert isinstance(await s.request(sm.AppendRequest(1, 0, 0, batch[:20], False)), sm.SuccessResponse)
    assert isinstance(await s.request(sm.AppendRequest(1, 0, 0, batch[20:], False)), sm.SuccessResponse)
    assert (await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == 49
    assert (await s.request(sm.RecordRequest(1, 0, 0, 7))).record == batch[7]
    assert (await s.request(sm.RecordHeaderRequest(1, 0, 0, 7))).record_header == batch[7].record_header
    assert (await s.request(sm.RecordRequest(1, 0, 0, 50))).record is None
    assert (await s.request(sm.RecordHeaderRequest(1, 0, 0, 50))).record_header is None
    assert (await s.request(sm.RecordListRequest(1, 0, 0, 15, 10))).records == batch[15:25]
    headers = await s.request(sm.RecordHeaderListRequest(1, 0, 0, 45, 100))
    assert headers.record_headers == tuple(r.record_header for r in batch[45:])
    truncated = await s.request(sm.TruncateRequest(1, 0, 0, 29, False))
    assert isinstance(truncated, sm.MaxTransactionIdResponse) and truncated.transaction_id == 29
    assert isinstance(await s.request(sm.SetLowWaterMarkRequest(2, 0, 0, 29, False)), sm.SuccessResponse)
    info = await s.request(sm.LastSessionInfoRequest(2, 0, 0, False))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (2, 29, 29)
    with pytest.raises(RemoteError, match="session 1 is fenced"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))
    with pytest.raises(RemoteError, match="partition 3 is not assigned"):
        await s.request(sm.MaxTransactionIdRequest(2, 0, 3, False))


@pytest_twisted.ensureDeferred
async def test_a_session_fence_survives_kill_9(store_params, start_storage, storage_clients):
    """docs/replication.md, "Fencing": once a newer store session has been answered (here its vote), an older
    session's appends stay refused after the storage is killed and restarted. The fence was in memory only:
    after a restart the old session's server could append again beside a recovery that had already voted."""
    daemon = start_storage()
    await assign(storage_clients, daemon, 0)
    s = await storage_clients.storage(daemon)
    await s.request(sm.AppendRequest(4, 0, 0, records(0, 3), False))
    assert (await s.request(sm.MaxTransactionIdRequest(6, 0, 0, False))).transaction_id == 2   # session 6 votes
    daemon.kill()
    await threads.deferToThread(daemon.start)
    s = await storage_clients.storage(daemon)
    with pytest.raises(RemoteError, match="session 4 is fenced: partition 0 is in session 6"):
        await s.request(sm.AppendRequest(4, 0, 0, records(3, 1), False))
    info = await s.request(sm.LastSessionInfoRequest(6, 0, 0, False))
    assert info.last_session_id == -1      # the session info changes only when a recovery sets its marks
    assert (await s.request(sm.MaxTransactionIdRequest(6, 0, 0, False))).transaction_id == 2


@pytest_twisted.ensureDeferred
async def test_every_admin_request_over_loopback(store_params, start_storage, storage_clients):
    daemon = start_storage()
    admin = await assign(storage_clients, daemon, 0, 2)
    status = await admin.request(am.AssignedPartitionStatusRequest(0))
    assert status.partition_status == ((0, True), (2, True))
    s = await storage_clients.storage(daemon)
    await s.request(sm.AppendRequest(3, 0, 2, records(0, 4, partition=2), False))
    await s.request(sm.SetLowWaterMarkRequest(3, 0, 2, 3, False))

    listed = await admin.request(am.RecordListRequest(0, 2, 1, 2))
    assert (listed.partition_id, listed.records) == (2, records(0, 4, partition=2)[1:3])
    info = await admin.request(am.LastSessionInfoRequest(0, 2))
    assert (info.last_session_id, info.low_water_mark, info.local_low_water_mark) == (3, 3, 3)
    metrics = json.loads((await admin.request(am.MetricsRequest(0))).metrics_json)
    assert metrics["waltz_storage_appended_records_total"]['{partition="2"}'] == 4

    await admin.request(am.PartitionWriteRequest(0, (2,), False))
    with pytest.raises(RemoteError, match="partition 2 is not writable"):
        await s.request(sm.AppendRequest(3, 0, 2, records(4, 1, partition=2), False))
    await admin.request(am.PartitionReadRequest(0, (2,), False))
    with pytest.raises(RemoteError, match="partition 2 is not readable"):
        await s.request(sm.RecordRequest(3, 0, 2, 0))
    await admin.request(am.PartitionReadRequest(0, (2,), True))
    await admin.request(am.PartitionWriteRequest(0, (2,), True))
    await s.request(sm.AppendRequest(3, 0, 2, records(4, 1, partition=2), False))

    await admin.request(am.PartitionAvailableRequest(0, (2,), False))
    with pytest.raises(RemoteError, match="partition 2 is not available"):
        await s.request(sm.MaxTransactionIdRequest(3, 0, 2, False))
    assert (await s.request(sm.MaxTransactionIdRequest(3, 0, 2, True))).transaction_id == 4
    status = await admin.request(am.AssignedPartitionStatusRequest(0))
    assert status.partition_status == ((0, True), (2, False))

    partition_dir = os.path.join(daemon.config["storage.directory"], "2")
    assert os.path.isdir(partition_dir)
    await admin.request(am.PartitionAssignmentRequest(0, (2,), False, True))
    assert not os.path.exists(partition_dir)
    assert (await admin.request(am.AssignedPartitionStatusRequest(0))).partition_status == ((0, True),)
    with pytest.raises(RemoteError, match="partition 2 is not assigned"):
        await admin.request(am.LastSessionInfoRequest(0, 2))


@pytest.mark.parametrize("admin", [False, True], ids=["storage-port", "admin-port"])
@pytest_twisted.ensureDeferred
async def test_open_with_wrong_key_or_partition_count_names_both_values(
        store_params, start_storage, storage_clients, admin):
    daemon = start_storage()
    other = uuid.UUID(int=12345)
    proto = await storage_clients.connect(daemon, admin=admin, key=other)
    with pytest.raises(RemoteError) as refused:
        await proto.opened
    assert str(store_params.key) in str(refused.value) and str(other) in str(refused.value)
    wrong_count = store_params.num_partitions + 3
    proto = await storage_clients.connect(daemon, admin=admin, num_partitions=wrong_count)
    with pytest.raises(RemoteError, match="has %d partitions, the request names %d"
                       % (store_params.num_partitions, wrong_count)):
        await proto.opened
    await (await storage_clients.connect(daemon, admin=admin)).opened  # the right values are still accepted


# --- HTTP --------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_http_ping_health_and_metrics(store_params, start_storage, storage_clients):
    daemon = start_storage()
    await assign(storage_clients, daemon, 1)
    s = await storage_clients.storage(daemon)
    await s.request(sm.AppendRequest(1, 0, 1, records(0, 7, partition=1), False))
    await s.request(sm.AppendRequest(1, 0, 1, records(7, 5, partition=1), False))
    assert await threads.deferToThread(daemon.http_get, "/ping") == (200, "pong\n")
    assert await threads.deferToThread(daemon.http_get, "/health") == (200, "healthy\n")
    status, text = await threads.deferToThread(daemon.http_get, "/metrics")
    assert status == 200
    lines = text.splitlines()
    assert '# TYPE waltz_storage_appended_records_total counter' in lines
    assert 'waltz_storage_appended_records_total{partition="1"} 12' in lines
    assert 'waltz_storage_requests_total{type="AppendRequest"} 2' in lines


# --- kill -9 under load --------------------------------------------------------------------------


class PipelinedAppender:
    """Keeps ``window`` append requests in flight on one connection, each carrying a random batch of
    records continuing the partition's ids, and ``kill()``s the daemon ``kill_delay`` seconds after
    the first request; :attr:`done` fires once every request has an outcome."""

    def __init__(self, proto, session_id, next_id, rng, sent, kill, kill_delay, window=100):
        self.proto = proto
        self.session_id = session_id
        self.next_id = next_id
        self.rng = rng
        self.sent = sent          # txn id -> Record, every record ever sent (acknowledged or not)
        self.kill = kill
        self.kill_delay = kill_delay
        self.window = window
        self.acked = []           # acknowledged records, in order
        self.requests = 0
        self.in_flight_at_kill = None
        self.unexpected = []      # failures other than the connection closing
        self.outstanding = 0
        self.stopped = False
        self.done = defer.Deferred()
        self._kill_call = None

    def start(self):
        self._kill_call = reactor.callLater(self.kill_delay, self._kill)
        for _ in range(self.window):
            self._send()
        return self.done

    def _kill(self):
        self.stopped = True
        self.in_flight_at_kill = self.outstanding
        self.kill()

    def _batch(self):
        batch = []
        for _ in range(self.rng.randint(1, 8)):
            txn = self.next_id
            data = self.rng.randbytes(self.rng.randint(0, 300))
            batch.append(Record.create(txn, ReqId(7, 1, 0, txn), self.rng.randint(-2**31, 2**31 - 1), data))
            self.next_id += 1
        return tuple(batch)

    def _send(self):
        if self.stopped:
            return
        batch = self._batch()
        self.sent.update((r.transaction_id, r) for r in batch)
        self.outstanding += 1
        self.requests += 1
        d = self.proto.request(sm.AppendRequest(self.session_id, 0, 0, batch, False))
        d.addCallbacks(self._acked, self._failed, callbackArgs=(batch,))
        d.addBoth(self._finished)

    def _acked(self, response, batch):
        if isinstance(response, sm.SuccessResponse):
            self.acked.extend(batch)
        else:
            self.unexpected.append(Failure(AssertionError("unexpected response %r" % (response,))))

    def _failed(self, failure):
        self.stopped = True
        if not failure.check(ConnectionClosed):
            self.unexpected.append(failure)

    def _finished(self, _):
        self.outstanding -= 1
        self._send()
        if self.outstanding == 0 and not self.done.called:
            if self._kill_call.active():  # every request failed before the kill
                self._kill_call.cancel()
            self.done.callback(self)


async def read_partition(proto, session_id, partition_id=0):
    """(max transaction id, every record 0..max) of a partition, read through list requests."""
    max_id = (await proto.request(sm.MaxTransactionIdRequest(session_id, 0, partition_id, False))).transaction_id
    found = []
    while len(found) <= max_id:
        listed = await proto.request(sm.RecordListRequest(session_id, 0, partition_id, len(found), 1000))
        assert listed.records, "records %d..%d are missing below the max %d" % (len(found), max_id, max_id)
        found.extend(listed.records)
    assert (await proto.request(sm.RecordRequest(session_id, 0, partition_id, max_id + 1))).record is None
    return max_id, found


def check_recovered(max_id, found, acked, sent):
    """Every acknowledged record is there, byte-identical; ids are dense from 0; every record up to
    the max is valid and is one that was sent."""
    assert [r.transaction_id for r in found] == list(range(max_id + 1))
    assert acked and max_id >= acked[-1].transaction_id
    for record in found:
        assert record.is_valid(), "record %d fails its checksum" % record.transaction_id
        assert record == sent[record.transaction_id], "record %d differs from what was sent" % record.transaction_id
    for record in acked:
        assert found[record.transaction_id] == record


@pytest_twisted.ensureDeferred
async def test_kill_9_during_pipelined_appends_loses_no_acknowledged_record(
        store_params, start_storage, storage_clients):
    daemon = start_storage(**{"storage.segment.size.threshold": 64 * 1024})
    await assign(storage_clients, daemon, 0)
    rng = random.Random(20240611)
    sent, acked, next_id, total_requests = {}, [], 0, 0
    for round_number in range(1, 4):
        s = await storage_clients.storage(daemon)
        appender = PipelinedAppender(s, round_number, next_id, rng, sent, daemon.kill,
                                     kill_delay=rng.uniform(0.2, 0.5))
        await appender.start()
        assert not appender.unexpected, appender.unexpected[0].getTraceback()
        assert not daemon.is_running() and appender.acked and appender.in_flight_at_kill
        acked.extend(appender.acked)
        total_requests += appender.requests

        await threads.deferToThread(daemon.start)
        s = await storage_clients.storage(daemon)
        max_id, found = await read_partition(s, round_number)
        check_recovered(max_id, found, acked, sent)
        next_id = max_id + 1
        for txn in [t for t in sent if t > max_id]:
            del sent[txn]  # lost in flight: the next round writes other records with these ids
    assert total_requests >= 300


# --- bad configs -----------------------------------------------------------------------------------


def _without_directory(config):
    del config["storage.directory"]


BAD_CONFIGS = {
    "unknown-key": (lambda c: c.update({"storage.bogus": 1}), "storage.bogus"),
    "bad-port": (lambda c: c.update({"storage.admin.port": 70000}), "storage.admin.port"),
    "missing-directory": (_without_directory, "storage.directory"),
    "equal-ports": (lambda c: c.update({"storage.http.port": c["storage.port"]}), "storage.http.port"),
    "bind-address": (lambda c: c.update({"storage.bindAddress": "not an address"}), "storage.bindAddress"),
    "frame-size": (lambda c: c.update({"storage.maxFrameSize": 1024}), "storage.maxFrameSize"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_non_zero_naming_the_key_and_binds_nothing(start_storage, case):
    change, key = BAD_CONFIGS[case]
    daemon = start_storage(start=False)
    change(daemon.config)
    daemon.write_config()
    result = subprocess.run(daemon.command(), capture_output=True, text=True, timeout=20,
                            stdin=subprocess.DEVNULL, cwd=daemon.run_dir)
    assert result.returncode == 1
    # One line on stderr naming the key; not twistd's usage text, which takes a bad file for a bad command line.
    [line] = result.stderr.splitlines()
    assert line.startswith("waltz-storage: ") and "'%s'" % key in line, line
    assert "Usage" not in result.stdout + result.stderr
    for name in ("storage.port", "storage.admin.port", "storage.http.port"):
        port = daemon.config[name]
        assert not (1 <= port <= 65535 and port_in_use("127.0.0.1", port)), "%s %d is bound" % (name, port)


# --- a corrupted control file ------------------------------------------------------------------------


def corrupt_both_structs(storage_dir, partition_id):
    """Break the checksum of both control-file structs of ``partition_id``."""
    with open(os.path.join(storage_dir, CONTROL_FILE_NAME), "r+b") as control:
        for slot in (0, 1):
            offset = HEADER_SIZE + PARTITION_INFO_SIZE * partition_id + 4 + STRUCT_SIZE * slot + 32
            control.seek(offset)
            crc = control.read(4)
            control.seek(offset)
            control.write(bytes(b ^ 0xFF for b in crc))


@pytest_twisted.ensureDeferred
async def test_corrupted_control_record_fails_only_that_partition(store_params, start_storage, storage_clients):
    daemon = start_storage()
    await assign(storage_clients, daemon, 0, 1)
    s = await storage_clients.storage(daemon)
    for pid in (0, 1):
        await s.request(sm.AppendRequest(1, 0, pid, records(0, 3, partition=pid), False))
    storage_clients.close()
    # twistd shuts down cleanly on SIGTERM, then re-raises the signal as its exit status
    assert await threads.deferToThread(daemon.stop) == -signal.SIGTERM
    corrupt_both_structs(daemon.config["storage.directory"], 1)

    await threads.deferToThread(daemon.start)
    s = await storage_clients.storage(daemon)
    with pytest.raises(RemoteError, match="partition 1 failed to open: .*corrupted"):
        await s.request(sm.MaxTransactionIdRequest(1, 0, 1, False))
    with pytest.raises(RemoteError, match="corrupted"):
        await s.request(sm.RecordRequest(1, 0, 1, 0))
    assert (await s.request(sm.MaxTransactionIdRequest(1, 0, 0, False))).transaction_id == 2
    await s.request(sm.AppendRequest(1, 0, 0, records(3, 2), False))
    assert (await s.request(sm.RecordListRequest(1, 0, 0, 0, 10))).records == records(0, 5)
    status, text = await threads.deferToThread(daemon.http_get, "/health")
    assert status == 503
    assert "partition 1 failed" in text and "partition 0" not in text
