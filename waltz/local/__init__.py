"""Processes for a local development cluster on 127.0.0.1 (ZooKeeper first; daemons later).

These helpers block while they wait for processes: use them from fixtures, the
``waltz`` command and benchmark scripts, never from reactor code.
"""
