"""``spark.read.format("waltz")`` against a real local cluster: full reads, ranges, header filters, splits,
every byte value, option errors."""

import pytest
import pytest_twisted

from twisted.internet import reactor

from tests.integration.test_client_server import eventually
from tests.spark.conftest import in_thread, rows_of
from waltz.client import WaltzClient, WaltzClientCallbacks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class Collector(WaltzClientCallbacks):
    """An application that records every transaction the feed delivers, with its data."""

    def __init__(self):
        self.rows = []
        self.marks = {}

    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        def applied(data):
            self.rows.append((transaction.partition_id, transaction.transaction_id, transaction.header,
                              transaction.req_id, data))
            self.marks[transaction.partition_id] = transaction.transaction_id
        return transaction.get_data().addCallback(applied)


def items(count, partitions=2):
    return [(i % partitions, i % 5, b"transaction %d " % i + bytes([i % 256]) * (i % 40)) for i in range(count)]


@pytest_twisted.ensureDeferred
async def test_a_full_read_equals_what_a_client_feed_delivers(spark, start_cluster):
    cluster = await start_cluster(partitions=2)
    await cluster.write(items(240))
    feed = Collector()
    client = WaltzClient(feed, {"zookeeper.connectString": cluster.local.connect_string,
                                "cluster.root": cluster.local.root}, reactor)
    try:
        await client.when_started()
        await eventually(lambda: len(feed.rows) == 240, "the feed to deliver 240 transactions")
    finally:
        await client.close()
    df = cluster.reader(spark, includeRequestId="true").load()
    assert df.columns == ["partition", "transaction_id", "header", "data", "client_id", "generation", "sequence"]
    rows = await in_thread(df.collect)
    got = sorted((r.partition, r.transaction_id, r.header, (r.client_id, r.generation, r.partition, r.sequence),
                  bytes(r.data)) for r in rows)
    want = sorted((p, t, h, (q.client_id, q.generation, q.partition_id, q.seq_num), d) for p, t, h, q, d in feed.rows)
    assert got == want
    assert {(p, t) for p, t, *_ in got} == {(p, t) for p in (0, 1) for t in range(120)}


@pytest_twisted.ensureDeferred
async def test_ranges_and_header_filters_fetch_only_the_data_they_return(spark, start_cluster):
    cluster = await start_cluster(partitions=2)
    written = items(200)
    await cluster.write(written)
    everything = await in_thread(rows_of, cluster.reader(spark).load())
    assert len(everything) == 200

    ranged = cluster.reader(spark, startingTransactionIds='{"0": 10, "1": -2}',
                            endingTransactionIds='{"0": 19}').load()
    assert await in_thread(rows_of, ranged) == [r for r in everything if (r[0] == 0 and 10 <= r[1] <= 19) or r[0] == 1]

    only_one = cluster.reader(spark, partitions="1", startingTransactionIds="latest").load()
    assert await in_thread(rows_of, only_one) == []

    before = await in_thread(cluster.served)
    filtered = await in_thread(rows_of, cluster.reader(spark, headers="1,3").load())
    assert filtered == [r for r in everything if r[2] in (1, 3)]
    assert await in_thread(cluster.served) - before == len(filtered)  # nothing else was fetched

    headers_only = await in_thread(rows_of, cluster.reader(spark, includeData="false", headers="4").load())
    assert headers_only == [r[:3] + (None,) for r in everything if r[2] == 4]
    assert await in_thread(cluster.served) - before == len(filtered)


@pytest_twisted.ensureDeferred
async def test_splits_give_several_input_partitions_and_the_same_rows(spark, start_cluster):
    cluster = await start_cluster(partitions=2)
    await cluster.write(items(150))
    whole = cluster.reader(spark).load()
    split = cluster.reader(spark, maxTransactionsPerSplit="20").load()
    assert await in_thread(lambda: whole.rdd.getNumPartitions()) == 2
    assert await in_thread(lambda: split.rdd.getNumPartitions()) == 8  # 75 per partition: 4 splits each
    assert await in_thread(rows_of, split) == await in_thread(rows_of, whole)


@pytest_twisted.ensureDeferred
async def test_data_with_every_byte_value_is_returned_unchanged(spark, start_cluster):
    cluster = await start_cluster(partitions=1)
    payloads = [bytes(range(256)), bytes(range(255, -1, -1)), b"", b"\x00" * 1000, bytes(range(256)) * 64]
    await cluster.write([(0, i, p) for i, p in enumerate(payloads)])
    rows = await in_thread(rows_of, cluster.reader(spark).load())
    assert [r[3] for r in rows] == payloads


@pytest_twisted.ensureDeferred
async def test_options_errors_name_the_option(spark, start_cluster):
    cluster = await start_cluster(partitions=2)
    await cluster.write(items(4))
    cases = [
        ({"partitions": "0-x"}, "'partitions'"),
        ({"partitions": "5"}, "partition 5 does not exist"),
        ({"startingTransactionIds": "{0: 1"}, "'startingTransactionIds'"),
        ({"endingTransactionIds": '{"0": 99}'}, "transaction 99 is not committed"),
        ({"maxTransactionsPerSplit": "0"}, "'maxTransactionsPerSplit'"),
        ({"includeData": "maybe"}, "'includeData'"),
    ]
    for options, message in cases:
        with pytest.raises(Exception, match=message):
            await in_thread(lambda: cluster.reader(spark, **options).load().collect())
    with pytest.raises(Exception, match="'cluster.root'"):
        await in_thread(lambda: spark.read.format("waltz").option("zookeeper", "127.0.0.1:1").load())
