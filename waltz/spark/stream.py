"""``spark.readStream.format("waltz")``: a stream that follows the log, with exactly-once offsets.

An offset is a JSON object of per-partition high-water marks (``{"0": 41, "1": 7}``:
partition 0 read up to transaction 41). The first offset comes from
``startingTransactionIds`` (default earliest, i.e. ``-1`` per partition; a partition
starting at ``latest`` is ``"latest"`` there, resolved by the first batch's end, so that
the first offset does not depend on when Spark asks for it: it asks again after a
restart); each trigger's latest offset is the partitions' current high-water marks; a
micro-batch from ``a`` to ``b`` reads ``a[p] + 1 .. b[p]`` of each partition, split by
``maxTransactionsPerSplit``. Spark writes the end offsets to the query's checkpoint
before it reads a batch, so a restarted query replays an unfinished batch with the
same bounds and goes on from the last committed offset: nothing skipped, nothing
read twice. The selected partitions cannot change between runs of one query (an
``OptionError`` names ``partitions``). ``endingTransactionIds`` does not apply to
streams (setting it is an error).

The driver-side client (high-water marks) is opened on first use and closed by
:meth:`WaltzStreamReader.stop`; it is never pickled to the executors.
"""

from pyspark.sql.datasource import DataSourceStreamReader

from waltz.spark.planning import initial_offsets, next_offset, plan_splits, selected_partitions, stream_ranges
from waltz.spark.reading import read_split, reading_client


class WaltzStreamReader(DataSourceStreamReader):
    """The streaming reader of the ``waltz`` data source (see the module docstring)."""

    def __init__(self, options, schema):
        self.options = options
        self.schema = schema
        self._client_context = None
        self._client = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_client_context"] = state["_client"] = None
        return state

    def _marks(self):
        if self._client is None:
            self._client_context = reading_client(self.options)
            self._client = self._client_context.__enter__()
        num_partitions = self._client.num_partitions
        return num_partitions, self._client.high_water_marks(selected_partitions(self.options, num_partitions))

    def initialOffset(self):
        num_partitions, marks = self._marks()
        return initial_offsets(self.options, num_partitions, marks)

    def latestOffset(self, start=None, limit=None):
        """The current high-water marks of the selected partitions (never behind ``start``)."""
        num_partitions, marks = self._marks()
        start = start if start else initial_offsets(self.options, num_partitions, marks)
        return next_offset(start, selected_partitions(self.options, num_partitions), marks)

    def partitions(self, start, end):
        return plan_splits(stream_ranges(start, end), self.options.max_per_split)

    def read(self, partition):
        return read_split(self.options, partition, self.schema)

    def commit(self, end):
        """Nothing to do: the log keeps everything; Spark's checkpoint holds the offsets."""

    def stop(self):
        if self._client_context is not None:
            context, self._client_context, self._client = self._client_context, None, None
            context.__exit__(None, None, None)
