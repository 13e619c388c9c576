"""The server daemon's configuration keys, defaults and validation.

The keys and defaults are the original's (``WaltzServerConfig``), except:

* ``server.http.port`` is the original's ``server.jetty.port`` (like the storage's
  ``storage.http.port``), with the shipped default 55182;
* ``server.bindAddress`` and ``server.host`` are this project's: the address the
  ports bind to, and the host the server advertises in its ZooKeeper descriptor
  for clients to connect to (the original advertised the machine's canonical
  host name). ``server.host`` defaults to ``127.0.0.1`` because this project runs
  clusters on one machine; set it to a name clients can reach in production;
* ``server.preferredPartitions`` (a list, or ``"0,2,5"``) is the original's
  preferred partitions of a managed server, which it only took through the CLI;
* ``server.maxFrameSize`` is this project's, as for the storage;
* the retry intervals are milliseconds in the file, as in the original;
* ``server.ssl.*`` (the client port) and ``storage.ssl.*`` (the connections to storage nodes) take PEM files
  (``certificate``, ``privateKey``, ``trustRoots``) instead of the original's Java key stores, and
  ``verifyHostname``: see :mod:`waltz.tls`;
* ``server.idleTimeout`` is this project's: see ``docs/protocol.md``, "Liveness".
"""

from waltz.config import (ZOOKEEPER_KEYS, ConfigError, Key, bind_address, check_distinct_ports, frame_size,
                          idle_timeout_milliseconds, load_config, milliseconds, non_negative_int, port, positive_int)
from waltz.server.caches import HEADER_BYTES, FeedCache
from waltz.tls import CONNECTS, SERVES, load_tls, tls_keys

#: The prefixes of the server's TLS keys: its client port, and its connections to storage nodes.
CLIENT_PORT_TLS_PREFIX = "server.ssl."
STORAGE_TLS_PREFIX = "storage.ssl."
#: The role of each prefix's certificate.
TLS_ROLES = {CLIENT_PORT_TLS_PREFIX: SERVES, STORAGE_TLS_PREFIX: CONNECTS}

MIB = 1024 * 1024
#: The feed cache must hold at least one block of headers.
MIN_FEED_CACHE_SIZE = FeedCache.BLOCK_SIZE * HEADER_BYTES


def feed_cache_size(value):
    """Bytes of the feed cache: at least one block of headers."""
    number = positive_int(value)
    if number < MIN_FEED_CACHE_SIZE:
        raise ValueError("expected at least %d bytes (one block of %d headers), got %d"
                         % (MIN_FEED_CACHE_SIZE, FeedCache.BLOCK_SIZE, number))
    return number


def partition_ids(value):
    """A list of partition ids: a YAML list of integers, or a string ``"0,2,5"``."""
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError("expected a list of partition ids")
    ids = []
    for item in items:
        try:
            number = non_negative_int(item)      # no bool, no float (1.9 is not partition 1)
        except ValueError:
            raise ValueError("expected partition ids (non-negative integers), got %r" % (item,)) from None
        ids.append(number)
    return tuple(sorted(set(ids)))


#: The lock table is a list of slots per partition (8 bytes each), allocated on the reactor thread when the
#: partition opens: 2**22 slots are 32 MiB per partition. (The slots come from 30 bits of each lock hash,
#: waltz.server.locks.SLOT_MASK, so more than 2**30 could never be used.) A size past the bound is refused when
#: the config is read, not when a partition opens after the ports are bound.
MAX_LOCK_TABLE_SIZE = 2 ** 22


def lock_table_size(value):
    """Slots of a partition's lock table: 1 to :data:`MAX_LOCK_TABLE_SIZE`."""
    number = positive_int(value)
    if number > MAX_LOCK_TABLE_SIZE:
        raise ValueError("expected at most %d slots per partition (8 bytes each, allocated when the partition "
                         "opens), got %d" % (MAX_LOCK_TABLE_SIZE, number))
    return number


def host_name(value):
    """A non-empty host name or address (no spaces, no port: clients join it with ``server.port``)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise ValueError("expected a host name or address")
    return text


SERVER_KEYS = ZOOKEEPER_KEYS + (
    Key("server.port", port, 55180, "port for Waltz clients (protocol L)"),
    Key("server.http.port", port, 55182, "port for /ping, /health and /metrics"),
    Key("server.bindAddress", bind_address, "0.0.0.0", "IP address the two ports bind to"),
    Key("server.host", host_name, "127.0.0.1", "host name or address advertised to clients in ZooKeeper"),
    Key("server.preferredPartitions", partition_ids, (), "partitions this server asks for first"),
    Key("server.optimisticLockTableSize", lock_table_size, 30000, "lock table slots per partition"),
    Key("server.feedCacheSize", feed_cache_size, 64 * MIB, "bytes of transaction headers cached for feeds"),
    Key("server.transactionDataCacheSize", non_negative_int, 128 * MIB, "bytes of transaction data cached"),
    Key("server.minFetchSize", positive_int, 100, "feed items granted per feed request at least"),
    Key("server.realtimeThreshold", positive_int, 1000, "feeds closer than this to the end are realtime"),
    Key("server.maxFrameSize", frame_size, 64 * MIB, "largest accepted client frame in bytes (at least 16 MiB)"),
    Key("server.idleTimeout", idle_timeout_milliseconds, 20000,
        "ms without receiving anything (not even a keep-alive) after which a connection to a client or a storage "
        "node is closed"),
    Key("storage.maxBatchSize", positive_int, 100, "appends per replicated batch"),
    Key("storage.initialRetryInterval", milliseconds, 100, "first storage reconnect delay, ms"),
    Key("storage.maxRetryInterval", milliseconds, 20000, "longest storage reconnect delay, ms"),
    Key("storage.requestTimeout", milliseconds, 30000,
        "ms a storage request may stay unanswered before its connection is closed and reopened"),
    Key("storage.checkpointInterval", positive_int, 250000,
        "transactions after which a store session is closed and a new one recovered"),
) + tls_keys(CLIENT_PORT_TLS_PREFIX) + tls_keys(STORAGE_TLS_PREFIX)

PORT_KEYS = ("server.port", "server.http.port")


def check_server_config(config):
    """Cross-key checks: distinct ports, retry bounds, ``minFetchSize < realtimeThreshold``."""
    check_distinct_ports(config, PORT_KEYS)
    if config["server.minFetchSize"] >= config["server.realtimeThreshold"]:
        raise ConfigError("config key 'server.minFetchSize': %d must be smaller than "
                          "'server.realtimeThreshold' (%d)"
                          % (config["server.minFetchSize"], config["server.realtimeThreshold"]),
                          "server.minFetchSize")
    if config["storage.initialRetryInterval"] > config["storage.maxRetryInterval"]:
        raise ConfigError("config key 'storage.initialRetryInterval': %d ms is above "
                          "'storage.maxRetryInterval' (%d ms)"
                          % (config["storage.initialRetryInterval"], config["storage.maxRetryInterval"]),
                          "storage.initialRetryInterval")
    for prefix, role in TLS_ROLES.items():
        load_tls(config, prefix, role)     # (read again by the service: here it fails before anything starts)
    return config


def partition_settings(config):
    """The :class:`~waltz.server.partition.PartitionSettings` of a validated server config."""
    from waltz.server.partition import PartitionSettings
    return PartitionSettings(
        lock_table_size=config["server.optimisticLockTableSize"],
        feed_cache_size=config["server.feedCacheSize"],
        transaction_data_cache_size=config["server.transactionDataCacheSize"],
        min_fetch_size=config["server.minFetchSize"],
        realtime_threshold=config["server.realtimeThreshold"])


def load_server_config(path):
    """Read and validate a server config file; :class:`ConfigError` names a bad key."""
    return check_server_config(load_config(path, SERVER_KEYS))
