"""Fault test: continuous appends through the store partition while storage daemons are killed with -9.

Three real ``twistd waltz-storage`` processes; the real store layer in this
process. One storage after another is killed (``SIGKILL``) under load and
restarted. At the end every acknowledged transaction is present exactly once
at the id it was acknowledged with, ids are dense, and the three replicas hold
identical record bytes.
"""

import glob
import os

import pytest_twisted
from twisted.internet import defer, reactor, task

from waltz.local.cluster import LocalCluster
from waltz.protocols.values import ReqId, checksum
from waltz.server.store.partition import AppendFailed
from waltz.server.store.store import Store
from waltz.storage.index import FILE_HEADER_SIZE as HEADER_SIZE
from waltz.zk.metadata import ClusterMetadata

IN_FLIGHT = 40


class Writer:
    """Keeps ``IN_FLIGHT`` appends outstanding; records what was acknowledged and what failed."""

    def __init__(self, partition):
        self.partition = partition
        self.next = 0
        self.acknowledged = {}   # transaction id -> payload
        self.failed = 0
        self.running = True
        self.outstanding = 0
        self.idle = defer.Deferred()

    def start(self):
        for _ in range(IN_FLIGHT):
            self._send()

    def _send(self):
        n = self.next
        self.next += 1
        data = b"append-%08d" % n
        self.outstanding += 1
        d = self.partition.append(ReqId(1, 1, 0, n), n, data, checksum(data))
        d.addCallbacks(self._acked, self._failed, callbackArgs=(data,))
        d.addBoth(self._done)

    def _acked(self, transaction_id, data):
        assert transaction_id not in self.acknowledged, "transaction %d reported twice" % transaction_id
        self.acknowledged[transaction_id] = data

    def _failed(self, failure):
        failure.trap(AppendFailed)
        self.failed += 1

    def _done(self, _):
        self.outstanding -= 1
        if self.running:
            reactor.callLater(0, self._send)  # never recurse on appends that fail at once
        elif self.outstanding == 0 and not self.idle.called:
            self.idle.callback(None)

    def stop(self):
        self.running = False
        if self.outstanding == 0 and not self.idle.called:
            self.idle.callback(None)
        return self.idle


def describe(partition):
    session = partition.session
    if session is None:
        return "no session"
    return "session %d %s joined %s recovery %s %s" % (
        session.session_id, session.state.value, sorted(session.joined), session.recovery.state.value,
        session.recovery.replica_states())


async def until(condition, timeout, what, partition=None):
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s%s" % (
                timeout, what, "; " + describe(partition) if partition is not None else ""))
        await task.deferLater(reactor, 0.05, lambda: None)


def record_bytes(storage_dir, partition=0):
    """The record bytes of every segment of a partition (segment headers hold creation times)."""
    body = b""
    for path in sorted(glob.glob(os.path.join(storage_dir, str(partition), "*.seg"))):
        with open(path, "rb") as stream:
            body += stream.read()[HEADER_SIZE:]
    return body


@pytest_twisted.ensureDeferred
async def test_acknowledged_appends_survive_storage_kill_9(zookeeper, zk_client, cluster_root, tmp_path):
    cluster = LocalCluster(str(tmp_path), num_partitions=1, num_storages=3, root=cluster_root,
                           zookeeper=zookeeper, storage_overrides={"storage.segment.size.threshold": 64 * 1024})
    store = None
    try:
        await cluster.start(reactor)
        store = Store(ClusterMetadata(zk_client, cluster_root), reactor, initial_retry=0.05, max_retry=0.5,
                      recovery_retry_interval=0.1)
        await store.start()
        partition = store.partition(0, 1)
        writer = Writer(partition)
        writer.start()
        for round_number, victim in enumerate([0, 1, 2, 0]):
            target = len(writer.acknowledged) + 300
            await until(lambda: len(writer.acknowledged) >= target, 30, "progress before kill %d" % round_number)
            cluster.storages[victim].kill()
            target = len(writer.acknowledged) + 300
            await until(lambda: len(writer.acknowledged) >= target, 30, "progress with a storage down")
            cluster.storages[victim].start()
            await until(lambda: partition.session is not None and len(partition.session.joined) == 3, 30,
                        "storage %d to rejoin" % victim, partition)
        await writer.stop()
        high_water_mark = await partition.flush()
    finally:
        if store is not None:
            await store.stop()
        await cluster.stop()

    acknowledged = writer.acknowledged
    assert len(acknowledged) >= 2400
    assert max(acknowledged) <= high_water_mark
    bodies = [record_bytes(d.config["storage.directory"]) for d in cluster.storages]
    assert bodies[0] == bodies[1] == bodies[2], "replicas differ"
    # Read the log back from one replica's files and check ids and payloads.
    from waltz.storage.partition_log import PartitionLog
    params = cluster.params
    log = PartitionLog.open(cluster.storages[0].config["storage.directory"], params.key, 0)
    try:
        records = log.read_records(0, high_water_mark + 10)
    finally:
        log.close()
    assert [r.transaction_id for r in records] == list(range(high_water_mark + 1)), "ids are not dense"
    assert all(r.is_valid() for r in records)
    by_id = {r.transaction_id: r.data for r in records}
    for transaction_id, data in acknowledged.items():
        assert by_id[transaction_id] == data, "acknowledged transaction %d lost or changed" % transaction_id
    payloads = [r.data for r in records]
    assert len(payloads) == len(set(payloads)), "a transaction is in the log twice"
