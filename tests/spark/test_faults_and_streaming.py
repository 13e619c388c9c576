"""A corrupted record on one replica is never returned; streaming follows the log and resumes from its
checkpoint exactly once."""

import os
import struct
import threading

import pytest
import pytest_twisted

from tests.integration.test_client_server import eventually
from tests.spark.conftest import in_thread, rows_of
from waltz.local.cluster import LocalCluster
from waltz.storage.index import FILE_HEADER_SIZE
from waltz.storage.segment import RECORD_HEADER_SIZE, list_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def corrupt_record(storage_dir, transaction_id):
    """Flip the first data byte of ``transaction_id``'s record in the (only) partition's segment files."""
    for directory, _, files in os.walk(storage_dir):
        firsts = [first for first in list_segments(directory) if first <= transaction_id]
        if not firsts:
            continue
        first = firsts[-1]
        with open(os.path.join(directory, "%019d.idx" % first), "rb") as index:
            index.seek(FILE_HEADER_SIZE + 8 * (transaction_id - first))
            (offset,) = struct.unpack(">q", index.read(8))
        with open(os.path.join(directory, "%019d.seg" % first), "r+b") as data:
            data.seek(offset + RECORD_HEADER_SIZE)
            byte = data.read(1)
            data.seek(offset + RECORD_HEADER_SIZE)
            data.write(bytes([byte[0] ^ 0xFF]))
        return
    raise AssertionError("no segment holds transaction %d under %s" % (transaction_id, storage_dir))


@pytest_twisted.ensureDeferred
async def test_a_corrupted_record_on_one_replica_is_not_returned(spark, start_cluster):
    cluster = await start_cluster(partitions=1, storages=2)
    written = [(0, 0, b"record %d" % i) for i in range(30)]
    await cluster.write(written)
    good = await in_thread(rows_of, cluster.reader(spark).load())
    # The server reads from the first replica in name order: damage transaction 10 there.
    reader_replica = min(cluster.local.storages, key=LocalCluster.storage_name)
    corrupt_record(reader_replica.config["storage.directory"], 10)
    try:
        rows = await in_thread(rows_of, cluster.reader(spark).load())
    except Exception as exc:  # failing is right, if it names what is wrong
        assert "partition 0" in str(exc) and ("transaction 10" in str(exc) or "record 10" in str(exc)), exc
    else:
        assert rows == good
    after = await in_thread(rows_of, cluster.reader(spark, startingTransactionIds='{"0": 11}').load())
    assert after == good[11:]


@pytest_twisted.ensureDeferred
async def test_streaming_picks_up_new_transactions_and_resumes_exactly_once(spark, start_cluster, tmp_path):
    cluster = await start_cluster(partitions=2)
    seen, lock = [], threading.Lock()

    def collect(batch, batch_id):
        rows = [(r.partition, r.transaction_id, bytes(r.data)) for r in batch.collect()]
        with lock:
            seen.extend(rows)

    def start():
        stream = spark.readStream.format("waltz")
        for key, value in {**cluster.options, "maxTransactionsPerSplit": "7"}.items():
            stream = stream.option(key, value)
        return (stream.load().writeStream.foreachBatch(collect)
                .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(processingTime="200 milliseconds")
                .start())

    def written(count, offset):
        return [(i % 2, 0, b"stream %d" % (offset + i)) for i in range(count)]

    await cluster.write(written(20, 0))
    query = await in_thread(start)
    try:
        await in_thread(query.processAllAvailable)
        assert len(seen) == 20
        await cluster.write(written(15, 20))
        await eventually(lambda: len(seen) >= 35, "the stream to pick up 15 new transactions")
        await in_thread(query.processAllAvailable)
    finally:
        await in_thread(query.stop)
    await cluster.write(written(10, 35))          # written while no query runs
    query = await in_thread(start)                # the same checkpoint: resumes after the last batch
    try:
        await in_thread(query.processAllAvailable)
        await eventually(lambda: len(seen) >= 45, "the restarted stream to read the 10 new transactions")
        await in_thread(query.processAllAvailable)
    finally:
        await in_thread(query.stop)
    assert len(seen) == 45, "read twice: %r" % sorted(seen)
    assert sorted((p, t) for p, t, _ in seen) == sorted([(0, t) for t in range(23)] + [(1, t) for t in range(22)])
    assert sorted(d for _, _, d in seen) == sorted(b"stream %d" % i for i in range(45))
