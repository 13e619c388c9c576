"""Building a SparkSession for Waltz jobs, tests and benchmarks, with the ``waltz`` source registered.

Local defaults that keep a job on loopback and light: ``SPARK_LOCAL_IP=127.0.0.1``
(unless set), the driver bound to 127.0.0.1, no UI, the Python workers running the
same interpreter as the driver (``PYSPARK_PYTHON``, unless set), modest driver memory.
"""

import os
import sys

from waltz.spark.source import register

#: Spark settings every session built here gets (``conf`` overrides them).
DEFAULT_CONF = {
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "1g",
    "spark.sql.shuffle.partitions": "4",
    "spark.python.worker.reuse": "true",
    "spark.ui.showConsoleProgress": "false",
}


def build_session(master="local[*]", app_name="waltz", conf=None):
    """A SparkSession (``getOrCreate``) on ``master`` (None: the one spark-submit gave) with the ``waltz`` data
    source registered."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return register(spark)
