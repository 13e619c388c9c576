"""The streaming reader's offsets, chunk sizing and Arrow batching, and the source's checks of what Spark
passes it: without a cluster (the driver's and the workers' clients are stand-ins)."""

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StringType, StructField, StructType

from waltz.client.api import TransactionRecord
from waltz.protocols.values import ReqId
from waltz.spark import reading
from waltz.spark.options import OptionError, parse_options
from waltz.spark.planning import UNRESOLVED_LATEST, WaltzSplit, next_offset, stream_ranges
from waltz.spark.reading import (
    FIRST_CHUNK_SIZE, MAX_CHUNK_SIZE, WaltzReadError, read_in_chunks, read_schema, read_split, to_record_batches)
from waltz.spark.source import WaltzDataSource
from waltz.spark.stream import WaltzStreamReader

BASE = {"zookeeper": "127.0.0.1:2181", "cluster.root": "/c"}


class DriverClient:
    """The driver's high-water marks, moved by the test."""

    def __init__(self, marks):
        self.marks = dict(marks)
        self.num_partitions = len(marks)

    def high_water_marks(self, partition_ids):
        return {pid: self.marks[pid] for pid in partition_ids}


def stream_reader(marks, **extra):
    reader = WaltzStreamReader(parse_options({**BASE, **extra}), read_schema())
    reader._client = DriverClient(marks)
    return reader


def covered(splits):
    return [(s.partition_id, txn) for s in splits for txn in range(s.start, s.end + 1)]


def test_a_stream_from_latest_starts_where_its_first_batch_ends_whenever_spark_asks():
    reader = stream_reader({0: 100, 1: 7}, startingTransactionIds='{"0": -1}')
    first = reader.initialOffset()
    assert first == {"0": UNRESOLVED_LATEST, "1": -1}
    reader._client.marks[0] = 105
    end0 = reader.latestOffset(first)          # Spark writes this to the checkpoint
    assert end0 == {"0": 105, "1": 7}
    reader._client.marks[0] = 108
    # Spark asks for the first offset again when it runs batch 0, and after a restart before batch 0
    # completed: the batch must be the same each time (it was 101..105, then nothing, before the fix)
    batch0 = covered(reader.partitions(reader.initialOffset(), end0))
    reader._client.marks[0] = 111
    assert covered(reader.partitions(reader.initialOffset(), end0)) == batch0
    assert batch0 == [(1, txn) for txn in range(8)]
    end1 = reader.latestOffset(end0)
    assert covered(reader.partitions(end0, end1)) == [(0, txn) for txn in range(106, 112)]


def test_a_stream_refuses_a_changed_partition_selection():
    reader = stream_reader({0: 10, 1: 10, 2: 10}, partitions="0-2")
    with pytest.raises(OptionError, match="option 'partitions'.*checkpoint has partitions 0,1"):
        reader.latestOffset({"0": 10, "1": 10})            # a checkpoint of an earlier run with "0-1"
    reader = stream_reader({0: 10, 1: 10, 2: 10}, partitions="0")
    with pytest.raises(OptionError, match="selects partitions 0, but"):
        reader.latestOffset({"0": 10, "1": 10})


def test_offsets_never_go_backwards():
    assert next_offset({"0": 12}, (0,), {0: 9}) == {"0": 12}    # a server behind the checkpoint
    with pytest.raises(ValueError, match="backwards"):
        stream_ranges({"0": 12}, {"0": 9})


def test_streams_refuse_an_ending_id_and_every_read_refuses_another_schema():
    source = WaltzDataSource({**BASE, "endingTransactionIds": "latest"})
    with pytest.raises(OptionError, match="option 'endingTransactionIds'.*does not apply to streams"):
        source.streamReader(source.schema())
    assert source.reader(source.schema()).schema == source.schema()
    other = StructType(list(read_schema().fields[:3]) + [StructField("data", StringType(), True)])
    with pytest.raises(ValueError, match="leave the schema out"):
        source.reader(other)
    with pytest.raises(ValueError, match="includeRequestId=false"):
        WaltzDataSource(BASE).streamReader(StructType(read_schema().fields[:2]))


def records(first, last, size):
    return [TransactionRecord(0, txn, 0, ReqId(1, 1, 0, txn), b"x" * size) for txn in range(first, last + 1)]


def chunk_sizes(start, end, data_size):
    """The transaction counts of the chunks that read ``start..end`` of ``data_size``-byte transactions."""
    return [len(got) for _, _, got in read_in_chunks(lambda first, last: records(first, last, data_size),
                                                     start, end)]


def test_chunks_are_sized_by_bytes():
    # small transactions: 100, 800, 6,400, then 50,000 at most
    assert chunk_sizes(0, 199_999, 100) == [100, 800, 6_400, 50_000, 50_000, 50_000, 42_700]
    # 4 MiB transactions: after the first chunk, 64 MiB (15 transactions) per chunk
    assert chunk_sizes(0, 199, 4 * 1024 * 1024) == [FIRST_CHUNK_SIZE, 15, 15, 15, 15, 15, 15, 10]
    assert chunk_sizes(5, 4, 100) == [] and chunk_sizes(7, 7, 100) == [1]
    assert MAX_CHUNK_SIZE == 50_000


def test_arrow_batches_stay_under_their_byte_limit(monkeypatch):
    monkeypatch.setattr(reading, "ARROW_BATCH_BYTES", 250)
    options = parse_options(BASE)
    schema = to_arrow_schema(read_schema())
    batches = list(to_record_batches(records(0, 9, 100), 0, options, schema))
    assert [b.num_rows for b in batches] == [2, 2, 2, 2, 2]
    assert pa.Table.from_batches(batches).column("transaction_id").to_pylist() == list(range(10))
    assert [b.num_rows for b in to_record_batches(records(0, 0, 1000), 0, options, schema)] == [1]
    assert [b.num_rows for b in to_record_batches([], 0, options, schema)] == [0]


def test_a_chunk_that_times_out_names_partition_range_and_option(monkeypatch):
    class Stuck:
        def read_transactions(self, *args, **kwargs):
            raise TimeoutError("no answer from the Waltz client within 300.0 s")
    monkeypatch.setattr(reading, "worker_client", lambda options: Stuck())
    with pytest.raises(WaltzReadError, match=r"partition 3: transactions 10\.\.109 were not read within 300\.0 s "
                                             r"\(option 'timeout'\)"):
        list(read_split(parse_options(BASE), WaltzSplit(3, 10, 500), read_schema()))
