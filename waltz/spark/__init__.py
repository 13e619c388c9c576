"""The PySpark data source ``waltz`` and the Spark jobs built on it (see docs/spark.md).

Importing this package needs ``pyspark`` and ``pyarrow`` (the ``spark`` extra).
"""

from waltz.spark.options import OptionError, ReadOptions, parse_options
from waltz.spark.reading import WaltzReadError, read_schema
from waltz.spark.source import WaltzDataSource, register

__all__ = ["OptionError", "ReadOptions", "WaltzDataSource", "WaltzReadError", "parse_options", "read_schema",
           "register"]
