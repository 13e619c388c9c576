"""The options of the ``waltz`` data source: parsing and validation into :class:`ReadOptions`.

Spark hands a data source its options as strings with lower-cased keys; every
option is checked here, once, on the driver, and a bad value raises
:class:`OptionError` naming the option and what it accepts. Everything that
depends on the cluster (does partition 7 exist? is transaction 100 committed?)
is checked later, by :mod:`waltz.spark.planning`.

Transaction id specs (``startingTransactionIds``, ``endingTransactionIds``)
follow Kafka's conventions: ``earliest``, ``latest`` or a JSON object of
per-partition ids such as ``{"0": 10, "1": -2}``, where ``-2`` is earliest and
``-1`` latest; partitions the JSON leaves out take the default. See
docs/spark.md for what the ids mean (both ends are inclusive).
"""

import json
from collections.abc import Mapping

import attr

from waltz.client.config import CLIENT_KEYS, client_config
from waltz.config import ConfigError
from waltz.partition_list import PartitionListError, parse_partition_list

#: The ``-2`` / ``-1`` of Kafka's offset specs.
EARLIEST = -2
LATEST = -1

#: Default of ``maxTransactionsPerSplit``.
DEFAULT_MAX_PER_SPLIT = 100_000
#: Default of ``timeout`` (seconds one read of a chunk of a split may take).
DEFAULT_TIMEOUT = 300.0

#: Longest ``timeout`` accepted: one day.
MAX_TIMEOUT = 86400.0

#: Client config keys that may be given as options (Spark lower-cases option keys; these restore the case).
_CLIENT_KEYS_BY_LOWER = {key.name.lower(): key.name for key in CLIENT_KEYS}
#: The documented spelling of each optional option, by its lower-cased key (Spark lower-cases the keys).
_NAMES = {name.lower(): name for name in (
    "partitions", "startingTransactionIds", "endingTransactionIds", "headers", "includeData", "includeRequestId",
    "maxTransactionsPerSplit", "timeout")}
#: The data source's own options, lower-cased; ``path`` is what ``load(path)`` passes (ignored).
_OPTIONS = ("zookeeper", "zookeeper.connectstring", "cluster.root", *_NAMES, "path")


class OptionError(ValueError):
    """A ``waltz`` data source option is missing or malformed; the message names it."""

    def __init__(self, option, problem):
        super().__init__("waltz data source option %r: %s" % (option, problem))
        self.option = option


@attr.s(frozen=True, slots=True)
class TransactionIdSpec:
    """A per-partition transaction id spec: ``default`` (EARLIEST or LATEST) for partitions not in
    ``per_partition`` (``{partition id: id, EARLIEST or LATEST}``)."""

    default = attr.ib()
    per_partition = attr.ib(factory=dict)

    def value_for(self, partition_id):
        return self.per_partition.get(partition_id, self.default)


@attr.s(frozen=True, slots=True)
class ReadOptions:
    """The validated options of one ``spark.read.format("waltz")`` (or ``readStream``)."""

    zookeeper = attr.ib()
    cluster_root = attr.ib()
    partitions = attr.ib(default=None)                 #: tuple of partition ids, None: all
    starting = attr.ib(default=TransactionIdSpec(EARLIEST))
    ending = attr.ib(default=TransactionIdSpec(LATEST))
    headers = attr.ib(default=None)                    #: frozenset of headers, None: every transaction
    include_data = attr.ib(default=True)
    include_request_id = attr.ib(default=False)
    max_per_split = attr.ib(default=DEFAULT_MAX_PER_SPLIT)
    timeout = attr.ib(default=DEFAULT_TIMEOUT)
    client_overrides = attr.ib(factory=dict)           #: client config keys given as options
    ending_given = attr.ib(default=False)              #: endingTransactionIds was set (streams refuse it)

    def client_config(self):
        """The config of the read-only client that plans and reads (``client.autoMount`` is set by it)."""
        config = {"zookeeper.connectString": self.zookeeper, "cluster.root": self.cluster_root}
        config.update(self.client_overrides)
        return config


def parse_options(options: Mapping) -> ReadOptions:
    """:class:`ReadOptions` from the data source's options (any key case); raises :class:`OptionError`."""
    values = {str(key).lower(): value for key, value in dict(options).items()}
    _check_known(values)
    parsed = _parse(values)
    try:
        client_config(parsed.client_config())
    except ConfigError as exc:
        key = exc.key or "client config"
        raise OptionError("zookeeper" if key == "zookeeper.connectString" else key, str(exc)) from None
    return parsed


def _parse(values):
    return ReadOptions(
        zookeeper=_connect_string(values),
        cluster_root=_required(values, "cluster.root"),
        partitions=_optional(values, "partitions", parse_partitions),
        starting=_optional(values, "startingtransactionids", lambda v: parse_id_spec("startingTransactionIds", v),
                           TransactionIdSpec(EARLIEST)),
        ending=_optional(values, "endingtransactionids", lambda v: parse_id_spec("endingTransactionIds", v,
                                                                                 allow_earliest=False),
                         TransactionIdSpec(LATEST)),
        headers=_optional(values, "headers", parse_headers),
        include_data=_optional(values, "includedata", lambda v: parse_bool("includeData", v), True),
        include_request_id=_optional(values, "includerequestid", lambda v: parse_bool("includeRequestId", v), False),
        max_per_split=_optional(values, "maxtransactionspersplit",
                                lambda v: parse_positive_int("maxTransactionsPerSplit", v), DEFAULT_MAX_PER_SPLIT),
        timeout=_optional(values, "timeout", parse_timeout, DEFAULT_TIMEOUT),
        client_overrides={_CLIENT_KEYS_BY_LOWER[key]: value for key, value in values.items()
                          if key in _CLIENT_KEYS_BY_LOWER and key not in ("zookeeper.connectstring", "cluster.root")},
        ending_given="endingtransactionids" in values,
    )


def _check_known(values):
    """A misspelled option (``startingTransactionId``, Kafka's ``startingOffsets``) would otherwise be
    ignored silently, and the read would cover the whole log."""
    unknown = sorted(key for key in values if key not in _OPTIONS and key not in _CLIENT_KEYS_BY_LOWER)
    if unknown:
        raise OptionError(unknown[0], "is not an option of the waltz data source (options: zookeeper, cluster.root, "
                          "partitions, startingTransactionIds, endingTransactionIds, headers, includeData, "
                          "includeRequestId, maxTransactionsPerSplit, timeout, and client.* / zookeeper.* "
                          "client config keys)")
    if "client.automount" in values:
        # Taken and then overridden, silently: the data source's clients read ranges, they never mount.
        raise OptionError("client.autoMount", "is set by the data source (its clients read ranges and never mount "
                          "a partition); leave it out")


def _connect_string(values):
    """``zookeeper``, or its client-config spelling ``zookeeper.connectString``; both given must agree (which
    of two different ensembles was meant cannot be guessed)."""
    given = {key: str(values[key]).strip() for key in ("zookeeper", "zookeeper.connectstring")
             if values.get(key) is not None}
    for key, value in given.items():
        if not value:
            raise OptionError("zookeeper" if key == "zookeeper" else "zookeeper.connectString",
                              "is empty (a ZooKeeper connect string such as 127.0.0.1:2181 is required)")
    if len(set(given.values())) > 1:
        raise OptionError("zookeeper", "is given twice, as zookeeper (%r) and as zookeeper.connectString (%r); "
                          "give one" % (given["zookeeper"], given["zookeeper.connectstring"]))
    return _required(values, "zookeeper", "zookeeper.connectstring")


def _required(values, name, *aliases):
    for key in (name,) + aliases:
        value = values.get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    raise OptionError(name, "is required (for example .option(%r, ...))" % name)


def _optional(values, key, parse, default=None):
    """The option ``key`` parsed, or ``default`` when it is not given. Given but blank is an error: an empty
    ``headers`` or ``partitions`` (a list joined from an empty selection) would otherwise read everything."""
    value = values.get(key)
    if value is None:
        return default
    if not str(value).strip():
        raise OptionError(_NAMES.get(key, key), "is empty; leave the option out for its default")
    return parse(str(value).strip())


def parse_partitions(text):
    """``"0-3,7"`` -> ``(0, 1, 2, 3, 7)`` (sorted, without repeats)."""
    try:
        return parse_partition_list(text)
    except PartitionListError as exc:
        raise OptionError("partitions", "%r: %s" % (text, exc)) from None


def parse_id_spec(name, text, allow_earliest=True):
    """``earliest`` / ``latest`` / ``{"0": 10, "1": -2}`` -> :class:`TransactionIdSpec`."""
    keyword = text.lower()
    if keyword in ("earliest", "latest"):
        if keyword == "earliest" and not allow_earliest:
            raise OptionError(name, "'earliest' is not allowed here (use 'latest' or per-partition ids)")
        return TransactionIdSpec(EARLIEST if keyword == "earliest" else LATEST)
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise OptionError(name, "%r is neither 'earliest', 'latest' nor JSON such as {\"0\": 10} (%s)"
                          % (text, exc)) from None
    if not isinstance(parsed, dict):
        raise OptionError(name, "the JSON must be an object of partition ids to transaction ids, not %r" % text)
    per_partition = {}
    for key, value in parsed.items():
        try:
            partition_id = int(key)
        except ValueError:
            raise OptionError(name, "%r is not a partition id" % key) from None
        if partition_id < 0:
            raise OptionError(name, "%r is not a partition id" % key)
        if partition_id in per_partition:
            raise OptionError(name, "partition %d is given twice" % partition_id)
        lowest = EARLIEST if allow_earliest else LATEST
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise OptionError(name, "partition %s: %r is not a transaction id (>= 0, or %s)"
                              % (key, value, "-2 earliest, -1 latest" if allow_earliest else "-1 latest"))
        per_partition[partition_id] = value
    return TransactionIdSpec(EARLIEST if allow_earliest else LATEST, per_partition)


def parse_headers(text):
    """``"1,2,5"`` or ``"[1, 2, 5]"`` -> ``frozenset({1, 2, 5})``."""
    items = text.strip().strip("[]")
    try:
        headers = frozenset(int(item) for item in items.split(",") if item.strip())
    except ValueError:
        raise OptionError("headers", "%r is not a list of integers such as 1,2,5" % text) from None
    if not headers or any(not -2 ** 31 <= header < 2 ** 31 for header in headers):
        raise OptionError("headers", "%r must list one or more 32-bit integers" % text)
    return headers


def parse_bool(name, text):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise OptionError(name, "%r is not true or false" % text)


def parse_positive_int(name, text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise OptionError(name, "%r is not a positive integer" % text)
    return value


def parse_timeout(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= MAX_TIMEOUT:      # also refuses nan and inf
        raise OptionError("timeout", "%r is not a number of seconds above 0 and at most %d (one day)"
                          % (text, MAX_TIMEOUT))
    return value
