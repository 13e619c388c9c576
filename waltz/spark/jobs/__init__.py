"""Spark jobs that derive data from a Waltz log (run with ``spark-submit`` or ``python -m``)."""
