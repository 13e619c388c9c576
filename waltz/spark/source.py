"""The ``waltz`` data source: ``spark.read.format("waltz")`` and ``spark.readStream.format("waltz")``.

Register it once per session (``register(spark)`` or
``spark.dataSource.register(WaltzDataSource)``), then::

    df = (spark.read.format("waltz")
          .option("zookeeper", "127.0.0.1:2181").option("cluster.root", "/waltz_cluster")
          .option("partitions", "0-3").load())

The driver reads the partitions' high-water marks with a read-only client and plans
:class:`~waltz.spark.planning.WaltzSplit` input partitions; the executors read them
(:mod:`waltz.spark.reading`). Options: :mod:`waltz.spark.options`; streaming:
:mod:`waltz.spark.stream`; everything together: docs/spark.md.
"""

from pyspark.sql.datasource import DataSource, DataSourceReader

from waltz.spark.options import OptionError, parse_options
from waltz.spark.planning import WaltzSplit, plan_ranges, plan_splits, selected_partitions
from waltz.spark.reading import read_schema, read_split, reading_client


class WaltzDataSource(DataSource):
    """The ``waltz`` data source (batch and streaming reads)."""

    @classmethod
    def name(cls):
        return "waltz"

    def __init__(self, options):
        super().__init__(options)
        self.read_options = parse_options(options)

    def schema(self):
        return read_schema(self.read_options.include_request_id)

    def reader(self, schema):
        return WaltzBatchReader(self.read_options, self._checked(schema))

    def streamReader(self, schema):
        from waltz.spark.stream import WaltzStreamReader
        if self.read_options.ending_given:
            raise OptionError("endingTransactionIds", "does not apply to streams (a streaming query follows "
                              "the log as it grows); remove it, or use spark.read for a bounded read")
        return WaltzStreamReader(self.read_options, self._checked(schema))

    def _checked(self, schema):
        """``schema`` if it is the source's own (``.schema(...)`` on the reader cannot change the layout:
        rows are built in it column by column), else an error saying what differs."""
        expected = self.schema()
        got = [(f.name, f.dataType) for f in schema.fields]
        if got != [(f.name, f.dataType) for f in expected.fields]:
            raise ValueError("the waltz data source reads the schema %s (includeRequestId=%s), not %s; leave "
                             "the schema out" % (expected.simpleString(),
                                                 str(self.read_options.include_request_id).lower(),
                                                 schema.simpleString()))
        return schema


class WaltzBatchReader(DataSourceReader):
    """A batch read: plans splits from the high-water marks at planning time, reads them on executors."""

    def __init__(self, options, schema):
        self.options = options
        self.schema = schema

    def partitions(self):
        with reading_client(self.options) as client:
            num_partitions = client.num_partitions
            # Only the selected partitions: one not served anywhere must not hold up a read of others.
            marks = client.high_water_marks(selected_partitions(self.options, num_partitions))
        splits = plan_splits(plan_ranges(self.options, num_partitions, marks), self.options.max_per_split)
        return splits or [WaltzSplit(0, 0, -1)]

    def read(self, partition):
        if partition.size <= 0:
            return iter(())
        return read_split(self.options, partition, self.schema)


def register(spark):
    """Register the ``waltz`` data source with a SparkSession; returns the session."""
    spark.dataSource.register(WaltzDataSource)
    return spark
