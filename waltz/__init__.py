"""Waltz in Python: a quorum-replicated, partitioned write-ahead log."""

__version__ = "0.1.0"
