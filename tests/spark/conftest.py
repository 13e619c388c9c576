"""Fixtures of the Spark data source tests: one local SparkSession for the whole run, and real local
Waltz clusters (ZooKeeper from tests/conftest.py, storage daemons from ``local_clusters``, a
``twistd waltz-server``).

Spark and Java are required: without them these tests fail (an import or session error), never skip.
Spark calls block, so tests run them with ``threads.deferToThread`` while the reactor serves the test's
own Waltz clients.
"""

import os
import re

import attr
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, threads

from tests.integration.conftest import daemons, local_clusters  # noqa: F401 (fixtures)
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.local.daemons import local_server
from waltz.spark.session import build_session


@pytest.fixture(scope="session")
def spark():
    """The run's one SparkSession (``local[2]``, UI off, loopback only), stopped at the end."""
    session = build_session("local[2]", "waltz-tests", {"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


class Append(TransactionContext):
    """One transaction of ``partition`` with ``header`` and ``data``, no locks."""

    def __init__(self, partition, header, data):
        self.partition, self.header, self.data = partition, header, data

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        return True


class Nothing(WaltzClientCallbacks):
    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        return None


@attr.s
class SparkCluster:
    """A started local cluster with its server, the data source options that reach it, and a writer."""

    local = attr.ib()
    server = attr.ib()
    writer = attr.ib(default=None)

    @property
    def options(self):
        return {"zookeeper": self.local.connect_string, "cluster.root": self.local.root}

    def reader(self, spark, **options):
        """``spark.read.format("waltz")`` with this cluster's options and ``options``."""
        read = spark.read.format("waltz")
        for key, value in {**self.options, **options}.items():
            read = read.option(key, value)
        return read

    async def write(self, items):
        """Append ``(partition, header, data)`` items; all must commit. Fires with the results."""
        results = await defer.gatherResults([self.writer.execute(Append(*item)) for item in items])
        assert all(result.committed for result in results), results
        return results

    def served(self):
        """The server's count of transactions whose data it sent (all partitions)."""
        _, text = self.server.http_get("/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if re.match(r"waltz_server_transaction_data_served_total[{ ]", line))


@pytest_twisted.async_yield_fixture
async def start_cluster(local_clusters, tmp_path, daemons):  # noqa: F811 (fixtures)
    """``await start_cluster(partitions=2, storages=1)`` -> a :class:`SparkCluster` (stopped after the test)."""
    writers = []

    async def make(partitions=2, storages=1):
        local = await local_clusters(partitions, storages)
        server = local_server(str(tmp_path / "server"), local.connect_string, local.root,
                              **{"zookeeper.sessionTimeout": 4000})
        daemons.append(server)
        await threads.deferToThread(server.start)
        writer = WaltzClient(Nothing(), {"zookeeper.connectString": local.connect_string, "cluster.root": local.root,
                                         "client.maxConcurrentTransactions": 100}, reactor)
        writers.append(writer)
        await writer.when_started()
        return SparkCluster(local, server, writer)

    yield make
    for writer in writers:
        await writer.close()


def in_thread(function, *args, **kwargs):
    """Run a blocking (Spark) call in a thread: the test's reactor keeps serving meanwhile."""
    return threads.deferToThread(function, *args, **kwargs)


def rows_of(df):
    """``[(partition, transaction_id, header, data), ...]`` sorted, from a DataFrame (blocking)."""
    return sorted((r["partition"], r["transaction_id"], r["header"], None if r["data"] is None else bytes(r["data"]))
                  for r in df.collect())


os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
