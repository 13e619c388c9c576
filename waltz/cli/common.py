"""Shared pieces of the ``waltz`` command: the user-error type, argparse option types, the one-line
description of an error, and option helpers."""

import argparse
import math
import os

from kazoo.exceptions import KazooException

from waltz.client.errors import WaltzClientError
from waltz import config
from waltz.config import ConfigError
from waltz.local.daemons import DaemonError
from waltz.local.zookeeper import ZooKeeperLaunchError
from waltz.partition_list import PartitionListError, check_partitions_exist, parse_partition_list
from waltz.zk.errors import ZooKeeperLayerError
from waltz.zk.metadata import MAX_PARTITIONS


class CliError(Exception):
    """A user-facing error: printed as one line ``waltz: error: <message>``, exit status 1."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


# --- argparse option types ----------------------------------------------------------------------


def argument_type(validate, expected):
    """An argparse type made of a :mod:`waltz.config` validator: what it refuses is reported as
    "expected <expected>, got <text>" (the config files and the command line accept the same values)."""
    def parse(text):
        try:
            return validate(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected %s, got %r" % (expected, text)) from None
    return parse


#: An argparse type: an integer >= 1 (counts).
positive_int = argument_type(config.positive_int, "a positive integer")


def positive_int_up_to(most, what):
    """An argparse type: an integer from 1 to ``most``, refused as "expected <what> from 1 to <most>"."""
    def parse(text):
        number = config.positive_int(text)
        if number > most:
            raise ValueError(number)
        return number
    return argument_type(parse, "%s from 1 to %d" % (what, most))


#: An argparse type: a cluster's number of partitions, 1 to :data:`~waltz.zk.metadata.MAX_PARTITIONS`.
partition_count = positive_int_up_to(MAX_PARTITIONS, "a partition count")
#: An argparse type: an integer >= 0 (ids, offsets).
non_negative_int = argument_type(config.non_negative_int, "a non-negative integer")
#: An argparse type: a TCP port number.
port = argument_type(config.port, "a port number 1-65535")
#: An argparse type: a ZooKeeper connect string.
connect_string = argument_type(config.connect_string, "a ZooKeeper connect string host:port[,host:port...] "
                                                      "(ports 1-65535)")
#: An argparse type: an absolute znode path.
znode_path = argument_type(config.znode_path, "an absolute znode path like /waltz_cluster")
#: An argparse type: milliseconds, 1 to a day (as the config files' millisecond keys).
milliseconds = argument_type(config.milliseconds, "milliseconds from 1 to %d (a day)" % config.MAX_MILLISECONDS)

#: The longest duration a seconds option accepts (a year; far larger values overflow the reactor's timers).
MAX_SECONDS = 366 * 86400


def positive_seconds(text):
    """An argparse type: a positive, finite number of seconds (timeouts, intervals, durations), at most
    :data:`MAX_SECONDS`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError("expected a positive number of seconds up to %d, got %r"
                                         % (MAX_SECONDS, text))
    return value


# --- errors as one line -------------------------------------------------------------------------

#: The environment variable that makes the command print tracebacks and Twisted's log on stderr.
DEBUG_VARIABLE = "WALTZ_DEBUG"


def debugging():
    """Whether the environment variable :data:`DEBUG_VARIABLE` is set (to anything but empty)."""
    return bool(os.environ.get(DEBUG_VARIABLE))


#: Errors whose message is written for the user: reported as their (first) line.
EXPECTED_ERRORS = (CliError, ConfigError, ZooKeeperLayerError, WaltzClientError, DaemonError, ZooKeeperLaunchError)


def _first_line(text):
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def error_message(exc):
    """What ``exc`` means, in one line: the message of the errors written for the user, the file and
    reason of an OS error, and ``<type>: <message>`` for anything else."""
    if isinstance(exc, EXPECTED_ERRORS):
        return _first_line(exc) or type(exc).__name__
    if isinstance(exc, KazooException):
        return "ZooKeeper request failed: %s %s" % (type(exc).__name__, _first_line(exc))
    if isinstance(exc, OSError) and exc.strerror:
        return "%s: %s" % (exc.filename, exc.strerror) if exc.filename else exc.strerror
    message = _first_line(exc)
    return "%s: %s" % (type(exc).__name__, message) if message else type(exc).__name__


# --- partition lists ----------------------------------------------------------------------------


def partition_list(text):
    """An argparse type: a partition list such as ``0-3,7`` (:func:`waltz.partition_list.parse_partition_list`),
    as a sorted tuple of ids. Whether they exist is :func:`existing_partitions`' question, once connected."""
    try:
        return parse_partition_list(text)
    except PartitionListError as exc:
        raise argparse.ArgumentTypeError("bad partition list %r: %s" % (text, exc)) from None


#: An argparse type: one partition id.
partition_id = argument_type(config.non_negative_int, "a partition id (0 or more)")


def existing_partitions(ids, num_partitions):
    """``ids`` (one id or a tuple of them) when a cluster of ``num_partitions`` partitions has them all;
    otherwise :class:`CliError` naming the highest."""
    try:
        check_partitions_exist((ids,) if isinstance(ids, int) else ids, num_partitions)
    except PartitionListError as exc:
        raise CliError(str(exc)) from None
    return ids
