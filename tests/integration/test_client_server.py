"""WaltzClient against real processes: ZooKeeper, three storage daemons (LocalCluster) and the
``twistd waltz-server`` daemon.

* concurrent clients whose transactions conflict on a lock: exactly the non-conflicting ones commit;
* every client sees the same transactions in the same order;
* a client restarted with its stored high-water mark resumes right after it;
* reading a range (the Spark path) and killing the server under a running client.
"""

import glob
import os
import sqlite3

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads

from tests.client.test_docs import bank_module
from waltz.client import Outcome, TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.local.cluster import LocalCluster
from waltz.local.daemons import local_server
from waltz.storage.index import FILE_HEADER_SIZE as SEGMENT_HEADER_SIZE
from waltz.storage.segment import RECORD_HEADER_SIZE, RECORD_OVERHEAD

pytestmark = pytest.mark.integration

PARTITIONS = 2
SESSION_TIMEOUT_MS = 4000


@pytest_twisted.async_fixture
async def cluster(local_clusters):
    """PARTITIONS partitions on three storage daemons (every partition on each)."""
    return await local_clusters(PARTITIONS, 3)


@pytest.fixture
def start_server(tmp_path, daemons):
    """``await start_server(cluster, name)`` -> a started server daemon, stopped by pid after the test."""
    async def make(local, name="server", **overrides):
        overrides.setdefault("zookeeper.sessionTimeout", SESSION_TIMEOUT_MS)
        overrides.setdefault("storage.maxRetryInterval", 1000)
        daemon = local_server(str(tmp_path / name), local.connect_string, local.root, **overrides)
        daemons.append(daemon)
        await threads.deferToThread(daemon.start)
        return daemon
    return make


class Log(WaltzClientCallbacks):
    """An application whose state is the list of transactions it applied, per partition."""

    def __init__(self, high_water_marks=None):
        self.high_water_marks = dict(high_water_marks or {})
        self.applied = {pid: [] for pid in range(PARTITIONS)}
        self.errors = []

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_marks.get(partition_id, -1)

    def apply_transaction(self, transaction):
        self.applied[transaction.partition_id].append((transaction.transaction_id, transaction.req_id,
                                                       transaction.header))
        self.high_water_marks[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(self, partition_id, transaction_id, exception):
        self.errors.append((partition_id, transaction_id, exception))


class Write(TransactionContext):
    """A transaction on ``partition`` writing the lock ``("account", account)``; computed once: if it has
    to be re-executed (its first attempt failed the lock check) it gives up (returns False)."""

    def __init__(self, partition, account, header=0):
        self.partition = partition
        self.account = account
        self.header = header

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        if getattr(self, "executed", False):
            return False
        self.executed = True
        builder.set_header(self.header)
        builder.set_transaction_data(b"account %d" % self.account)
        builder.set_write_locks([("account", self.account)])
        return True


class Plain(Write):
    """A transaction without locks, retried until it commits."""

    def execute(self, builder):
        builder.set_header(self.header)
        builder.set_transaction_data(b"plain %d" % self.header)
        return True


async def eventually(check, what, timeout=30.0):
    """Poll ``check()`` (plain function) until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = reactor.seconds() + timeout
    while not check():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        await task.deferLater(reactor, 0.05, lambda: None)


async def new_client(local, clients, callbacks=None, **config):
    settings = {"zookeeper.connectString": local.connect_string, "cluster.root": local.root,
                "zookeeper.sessionTimeout": 10000}
    settings.update(config)
    client = WaltzClient(callbacks if callbacks is not None else Log(), settings, reactor)
    clients.append(client)
    await client.when_started()
    return client


async def caught_up(client, callbacks, timeout=30.0):
    """Wait until ``callbacks`` applied every partition up to its current high-water mark."""
    marks = await client.high_water_marks()
    await eventually(lambda: all(callbacks.high_water_marks.get(pid, -1) >= hwm for pid, hwm in marks.items()),
                     "the client to apply up to %s" % marks, timeout)
    return marks


@pytest_twisted.ensureDeferred
async def test_conflicting_clients_only_the_non_conflicting_commit_and_all_see_one_order(cluster, start_server,
                                                                                           clients):
    await start_server(cluster)
    logs = [Log() for _ in range(3)]
    waltz = [await new_client(cluster, clients, log) for log in logs]
    warm_up = await defer.gatherResults([c.execute(Plain(0, 0, header=100 + i)) for i, c in enumerate(waltz)])
    assert all(r.committed for r in warm_up)
    for client, log in zip(waltz, logs):
        await caught_up(client, log)
    assert len({log.high_water_marks[0] for log in logs}) == 1

    # in one reactor turn, every client builds against the same high-water mark: three write the same
    # lock, and each writes one lock of its own
    conflicting = [Write(0, 1, header=i) for i in range(3)]
    independent = [Write(0, 10 + i, header=10 + i) for i in range(3)]
    results = [client.execute(context) for client, context in zip(waltz, conflicting)]
    results += [client.execute(context) for client, context in zip(waltz, independent)]
    outcomes = [r.outcome for r in await defer.gatherResults(results)]

    assert outcomes[:3].count(Outcome.COMMITTED) == 1
    assert outcomes[:3].count(Outcome.IGNORED) == 2     # lock failure, then re-executed and given up
    assert outcomes[3:] == [Outcome.COMMITTED] * 3
    for client, log in zip(waltz, logs):
        await caught_up(client, log)
    assert logs[0].applied == logs[1].applied == logs[2].applied
    committed_headers = sorted(header for _, _, header in logs[0].applied[0])
    assert committed_headers == sorted([100, 101, 102, 10, 11, 12, outcomes.index(Outcome.COMMITTED)])
    assert [txn for txn, _, _ in logs[0].applied[0]] == list(range(7))
    assert not any(log.errors for log in logs)


@pytest_twisted.ensureDeferred
async def test_a_restarted_client_resumes_after_its_high_water_mark(cluster, start_server, clients):
    await start_server(cluster)
    first_log = Log()
    first = await new_client(cluster, clients, first_log)
    for i in range(3):
        assert (await first.execute(Plain(1, 0, header=i))).committed
    await caught_up(first, first_log)
    stored = dict(first_log.high_water_marks)
    await first.close()

    writer = await new_client(cluster, clients)
    for i in range(3, 5):
        assert (await writer.execute(Plain(1, 0, header=i))).committed

    resumed_log = Log(stored)
    resumed = await new_client(cluster, clients, resumed_log)
    await caught_up(resumed, resumed_log)
    assert [(txn, header) for txn, _, header in resumed_log.applied[1]] == [(3, 3), (4, 4)]
    assert resumed_log.applied[0] == []


@pytest_twisted.ensureDeferred
async def test_read_transactions_and_data_from_the_log(cluster, start_server, clients):
    await start_server(cluster)
    log = Log()
    client = await new_client(cluster, clients, log)
    for header in range(6):
        assert (await client.execute(Plain(0, 0, header=header % 3))).committed
    reader = await new_client(cluster, clients, **{"client.autoMount": False})
    records = await reader.read_transactions(0, 1, 4, headers={0, 1})
    assert [(r.transaction_id, r.header, r.data) for r in records] == [
        (1, 1, b"plain 1"), (3, 0, b"plain 0"), (4, 1, b"plain 1")]
    assert await reader.get_transaction_data(0, 5) == b"plain 2"
    assert await reader.high_water_marks() == {0: 5, 1: -1}
    # the reads did not disturb the writer's mount
    assert (await client.execute(Plain(0, 0, header=7))).committed


@pytest_twisted.ensureDeferred
async def test_a_client_survives_its_server_being_killed(cluster, start_server, clients):
    server = await start_server(cluster, "server1")
    log = Log()
    client = await new_client(cluster, clients, log)
    assert (await client.execute(Plain(0, 0, header=1))).committed
    await start_server(cluster, "server2")
    await threads.deferToThread(server.kill)
    # the partition moves to server2 once ZooKeeper expires server1's session; meanwhile executions wait
    results = await defer.gatherResults([client.execute(Plain(pid, 0, header=2)) for pid in (0, 1)])
    assert all(r.committed for r in results)
    await caught_up(client, log)
    assert [header for _, _, header in log.applied[0]] == [1, 2]
    assert [header for _, _, header in log.applied[1]] == [2]


def damage_record(storage, transaction_id, partition=0):
    """Flip a data byte of ``transaction_id`` in ``storage``'s segment file, as a failing disk would."""
    offset = SEGMENT_HEADER_SIZE
    path, = glob.glob(os.path.join(storage.config["storage.directory"], str(partition), "*.seg"))
    with open(path, "r+b") as stream:
        for _ in range(transaction_id):           # records are back to back: header, data, crc
            stream.seek(offset + RECORD_HEADER_SIZE - 8)
            offset += RECORD_OVERHEAD + int.from_bytes(stream.read(4), "big", signed=True)
        stream.seek(offset + RECORD_HEADER_SIZE)
        byte = stream.read(1)
        stream.seek(offset + RECORD_HEADER_SIZE)
        stream.write(bytes([byte[0] ^ 0xFF]))


@pytest_twisted.ensureDeferred
async def test_records_damaged_on_two_storages_are_read_from_the_third(cluster, start_server, clients):
    server = await start_server(cluster, "server1")
    writer = await new_client(cluster, clients)
    for header in range(5):
        assert (await writer.execute(Plain(0, 0, header=header))).committed
    await writer.close()
    # The server reads from the storages in the order of their names: damage transaction 2 on the two
    # it asks first. A server started now has nothing cached, so feeds and data come from the storages.
    first, second, _ = sorted(cluster.storages, key=cluster.storage_name)
    damage_record(first, 2)
    damage_record(second, 2)
    await threads.deferToThread(server.stop)
    await start_server(cluster, "server2")

    log = Log()
    reader = await new_client(cluster, clients, log)
    await caught_up(reader, log)                  # the catch-up feed read the headers past the damage
    assert [header for _, _, header in log.applied[0]] == [0, 1, 2, 3, 4]
    assert await reader.get_transaction_data(0, 2) == b"plain 2"
    records = await reader.read_transactions(0, 0, 4)
    assert [r.data for r in records] == [b"plain %d" % n for n in range(5)]


@pytest_twisted.ensureDeferred
async def test_the_bank_example_of_the_docs_refuses_the_overdraft(cluster, start_server, tmp_path, capsys):
    await start_server(cluster)
    config = tmp_path / "client.yaml"
    config.write_text("zookeeper.connectString: %s\ncluster.root: %s\n" % (cluster.connect_string, cluster.root))
    db = str(tmp_path / "bank.db")
    await bank_module()["main"](reactor, str(config), db)
    out = capsys.readouterr().out
    assert "['committed', 'ignored']" in out or "['ignored', 'committed']" in out
    assert "raced another one; trying again" in out          # the loser failed the lock check first
    connection = sqlite3.connect(db)
    try:
        assert connection.execute("SELECT BALANCE FROM ACCOUNTS WHERE ID = 1").fetchone() == (40,)
    finally:
        connection.close()


@pytest_twisted.ensureDeferred
async def test_a_client_mounted_on_a_server_that_gave_up_its_partitions_mounts_again(tmp_path, cluster_root,
                                                                                      start_server, clients):
    # ZooKeeper (this test's own) stays down past 0.8 of the server's session timeout: the server gives
    # its partitions up. ZooKeeper comes back with the session alive, and the server takes the same
    # partitions back at the same generations: a client's map does not change. Its mount must not
    # silently vanish with the closed partition (appends dropped as not mounted, no feed, for good).
    local = LocalCluster(str(tmp_path / "own"), num_partitions=1, num_storages=1, root=cluster_root)
    try:
        await local.start(reactor)
        server = await start_server(local, **{"zookeeper.sessionTimeout": 8000})
        log = Log()
        client = await new_client(local, clients, log, **{"client.transactionExpiration": 120000})
        assert (await client.execute(Plain(0, 0, header=1))).committed
        await local.zk_client.close()
        local.zk_client = None
        await threads.deferToThread(local.zookeeper.stop)

        async def partitions_held():
            _, text = await threads.deferToThread(server.http_get, "/metrics")
            return [int(float(line.split()[-1])) for line in text.splitlines()
                    if line.startswith("waltz_server_partitions ")]
        deadline = reactor.seconds() + 30
        while await partitions_held() != [0]:
            assert reactor.seconds() < deadline, "the server did not give its partition up"
            await task.deferLater(reactor, 0.2, lambda: None)

        await threads.deferToThread(local.zookeeper.start)
        result = await client.execute(Plain(0, 0, header=2)).addTimeout(60, reactor)
        assert result.committed
        await caught_up(client, log)
        assert [header for _, _, header in log.applied[0]] == [1, 2]
    finally:
        await local.stop()
