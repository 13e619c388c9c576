"""What runs on the executors: reading one :class:`~waltz.spark.planning.WaltzSplit` into Arrow batches.

A split is read by the Python worker's read-only :class:`~waltz.client.blocking.BlockingWaltzClient`
(:func:`worker_client`: one per worker, reused by its tasks; its reactor runs in a
daemon thread of the worker), in chunks, each one ``read_transactions`` call: the
client verifies every record's CRC32C and fails on a gap in the feed. Chunks are
sized by bytes (:func:`next_chunk_size`): the first is :data:`FIRST_CHUNK_SIZE`
transactions, each next one aims at :data:`CHUNK_BYTES` of data from the sizes read
so far, growing at most :data:`CHUNK_GROWTH` times and never above
:data:`MAX_CHUNK_SIZE` transactions, so a worker holds a bounded amount of data
whatever the transactions' sizes. Each chunk is checked again here (ids inside the
range, increasing, none missing when no header filter applies, data present when
asked for) and becomes ``pyarrow.RecordBatch`` objects in the schema's exact Arrow
layout, each of at most :data:`ARROW_BATCH_BYTES` of data (an Arrow binary column
holds at most 2 GiB). Any problem raises :class:`WaltzReadError` naming the
partition and transactions: a task fails, it never returns a silent gap.
"""

import atexit
import contextlib
import json

import pyarrow as pa
from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType

from waltz.client.blocking import BlockingWaltzClient

#: Transactions of a split's first ``read_transactions`` call (at the largest transaction data size,
#: 15 MB, still under 2 GB).
FIRST_CHUNK_SIZE = 100
#: Transactions of one ``read_transactions`` call, at most.
MAX_CHUNK_SIZE = 50_000
#: The data (and per-record overhead) a chunk aims at, from the average size read so far.
CHUNK_BYTES = 64 * 1024 * 1024
#: How many times larger than the previous one a chunk may be.
CHUNK_GROWTH = 8
#: Counted per record on top of its data when sizing chunks (ids, header, request id, Python objects).
RECORD_OVERHEAD_BYTES = 100
#: The data of one Arrow record batch, at most (a binary column's offsets are 32-bit: 2 GiB).
ARROW_BATCH_BYTES = 256 * 1024 * 1024

#: The columns every read has.
BASE_FIELDS = (
    StructField("partition", IntegerType(), False),
    StructField("transaction_id", LongType(), False),
    StructField("header", IntegerType(), False),
    StructField("data", BinaryType(), True),
)
#: The request id columns (``includeRequestId``).
REQUEST_ID_FIELDS = (
    StructField("client_id", IntegerType(), False),
    StructField("generation", IntegerType(), False),
    StructField("sequence", IntegerType(), False),
)


class WaltzReadError(RuntimeError):
    """A split could not be read completely and correctly; the message names partition and transaction."""


def read_schema(include_request_id=False) -> StructType:
    """The schema of a read: ``partition int, transaction_id long, header int, data binary`` (+ request id)."""
    return StructType(list(BASE_FIELDS + (REQUEST_ID_FIELDS if include_request_id else ())))


@contextlib.contextmanager
def reading_client(options):
    """A read-only blocking client for ``options`` (:class:`~waltz.spark.options.ReadOptions`), closed after."""
    client = BlockingWaltzClient.for_reading(options.client_config(), timeout=options.timeout)
    try:
        yield client
    finally:
        client.close()


def next_chunk_size(previous, records_read, bytes_read):
    """The size in transactions of the next chunk, after chunks of ``previous`` transactions gave
    ``records_read`` records of ``bytes_read`` bytes (data and per-record overhead) in all."""
    if records_read == 0:
        return min(MAX_CHUNK_SIZE, previous * CHUNK_GROWTH)    # filtered out, or no data: nothing held
    average = max(1, bytes_read // records_read)
    return max(1, min(MAX_CHUNK_SIZE, previous * CHUNK_GROWTH, CHUNK_BYTES // average))


def record_bytes(records):
    """The bytes ``records`` hold, as chunk sizing counts them."""
    return sum(len(r.data or b"") + RECORD_OVERHEAD_BYTES for r in records)


#: Read-only clients of this Python worker, by client config (see :func:`worker_client`).
_worker_clients = {}


def worker_client(options):
    """The read-only client of this Python worker for ``options``' cluster, started on first use.

    Spark reuses a Python worker for many tasks (``spark.python.worker.reuse``, the default),
    so every split a worker reads shares one client instead of each joining the cluster again
    (a ZooKeeper session, discovery, connections: a large part of a small split's time). It
    is dropped after a failed read, and closed when a split of another cluster comes or the
    worker exits normally (PySpark may end a worker with ``os._exit``; its ZooKeeper session then
    expires by itself). A Python worker runs one task at a time, so the cache needs no lock.
    """
    key = _client_key(options)
    client = _worker_clients.get(key)
    if client is None:
        close_worker_clients()          # one cluster at a time: a client of another one would linger
        atexit.unregister(close_worker_clients)
        atexit.register(close_worker_clients)
        client = _worker_clients[key] = BlockingWaltzClient.for_reading(options.client_config(),
                                                                        timeout=options.timeout)
    return client


def _client_key(options):
    return json.dumps([options.client_config(), options.timeout], sort_keys=True)


def close_worker_clients():
    """Close every client :func:`worker_client` started in this process (idempotent)."""
    while _worker_clients:
        _, client = _worker_clients.popitem()
        with contextlib.suppress(Exception):
            client.close()


def _drop_worker_client(options):
    client = _worker_clients.pop(_client_key(options), None)
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def read_split(options, split, schema):
    """Yield the split's rows as ``pyarrow.RecordBatch`` objects in ``schema``'s Arrow layout."""
    from pyspark.sql.pandas.types import to_arrow_schema
    arrow_schema = to_arrow_schema(schema)
    client = worker_client(options)
    for first, last, records in read_in_chunks(
            lambda first, last: _read_chunk(client, options, split.partition_id, first, last),
            split.start, split.end):
        check_records(records, split.partition_id, first, last, options)
        yield from to_record_batches(records, split.partition_id, options, arrow_schema)


def read_in_chunks(read, start, end):
    """Yield ``(first, last, records)`` for the chunks of ``start..end``, ``records`` being what
    ``read(first, last)`` returned; chunks are sized by bytes (see the module docstring)."""
    first, size, records_read, bytes_read = start, FIRST_CHUNK_SIZE, 0, 0
    while first <= end:
        last = min(end, first + size - 1)
        records = read(first, last)
        yield first, last, records
        records_read += len(records)
        bytes_read += record_bytes(records)
        first, size = last + 1, next_chunk_size(size, records_read, bytes_read)


def _read_chunk(client, options, partition_id, first, last):
    try:
        return client.read_transactions(partition_id, first, last, options.headers, options.include_data,
                                        committed=True)
    except BaseException as exc:
        _drop_worker_client(options)    # start the next split with a fresh client
        if isinstance(exc, TimeoutError):
            raise WaltzReadError("partition %d: transactions %d..%d were not read within %s s (option "
                                 "'timeout'): %s" % (partition_id, first, last, options.timeout, exc)) from exc
        raise


def check_records(records, partition_id, first, last, options):
    """Raise :class:`WaltzReadError` unless ``records`` are exactly what ``first..last`` must give."""
    expected = first
    for record in records:
        txn = record.transaction_id
        if record.partition_id != partition_id or txn < expected or txn > last:
            raise WaltzReadError("partition %d: transaction %d read where %d..%d was expected"
                                 % (partition_id, txn, expected, last))
        if options.headers is None and txn != expected:
            raise WaltzReadError("partition %d: transaction %d is missing (the read went from %d to %d)"
                                 % (partition_id, expected, expected - 1, txn))
        if options.headers is not None and record.header not in options.headers:
            raise WaltzReadError("partition %d transaction %d: header %d is not one of the requested headers"
                                 % (partition_id, txn, record.header))
        if options.include_data and record.data is None:
            raise WaltzReadError("partition %d transaction %d: its data is missing" % (partition_id, txn))
        expected = txn + 1
    if options.headers is None and expected != last + 1:
        raise WaltzReadError("partition %d: transactions %d..%d are missing" % (partition_id, expected, last))


def to_record_batches(records, partition_id, options, arrow_schema):
    """Arrow batches of ``records`` in order, each of at most :data:`ARROW_BATCH_BYTES` of data (or one
    record)."""
    begin, size = 0, 0
    for index, record in enumerate(records):
        length = len(record.data or b"")
        if index > begin and size + length > ARROW_BATCH_BYTES:
            yield to_record_batch(records[begin:index], partition_id, options, arrow_schema)
            begin, size = index, 0
        size += length
    if begin < len(records) or not records:
        yield to_record_batch(records[begin:], partition_id, options, arrow_schema)


def to_record_batch(records, partition_id, options, arrow_schema):
    """One Arrow batch of ``records`` (the data column is null without ``includeData``)."""
    count = len(records)
    columns = [
        pa.array([partition_id] * count, pa.int32()),
        pa.array([r.transaction_id for r in records], pa.int64()),
        pa.array([r.header for r in records], pa.int32()),
        pa.array([r.data for r in records] if options.include_data else [None] * count, pa.binary()),
    ]
    if options.include_request_id:
        columns += [pa.array([r.req_id.client_id for r in records], pa.int32()),
                    pa.array([r.req_id.generation for r in records], pa.int32()),
                    pa.array([r.req_id.seq_num for r in records], pa.int32())]
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema)
