"""What runs on the executors: reading one :class:`~waltz.spark.planning.WaltzSplit` into Arrow batches.

A split is read by the Python worker's read-only :class:`~waltz.client.blocking.BlockingWaltzClient`
(:func:`worker_client`: one per worker, reused by its tasks; its reactor runs in a
daemon thread of the worker), in chunks of
:data:`CHUNK_SIZE` transactions, each one ``read_transactions`` call: the
client verifies every record's CRC32C and fails on a gap in the feed. Each chunk
is checked again here (ids inside the range, increasing, none missing when no
header filter applies, data present when asked for) and becomes one
``pyarrow.RecordBatch`` in the schema's exact Arrow layout. Any problem raises
:class:`WaltzReadError` naming the partition and transaction: a task fails, it
never returns a silent gap.
"""

import atexit
import contextlib
import json

import pyarrow as pa
from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType

from waltz.client.blocking import BlockingWaltzClient

#: Transactions per ``read_transactions`` call (and per Arrow batch).
CHUNK_SIZE = 50_000

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


def chunks(start, end, size=CHUNK_SIZE):
    """``(first, last)`` pieces of ``start..end`` of at most ``size`` transactions."""
    return [(first, min(end, first + size - 1)) for first in range(start, end + 1, size)]


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
    for first, last in chunks(split.start, split.end):
        try:
            records = client.read_transactions(split.partition_id, first, last, options.headers,
                                               options.include_data, committed=True)
        except BaseException:
            _drop_worker_client(options)    # start the next split with a fresh client
            raise
        check_records(records, split.partition_id, first, last, options)
        yield to_record_batch(records, split.partition_id, options, arrow_schema)


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
