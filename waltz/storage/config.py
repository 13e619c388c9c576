"""The storage daemon's configuration keys, defaults and validation.

``storage.ssl.*`` (``certificate``, ``privateKey``, ``trustRoots``: PEM files) turns on mutual TLS on the
storage and admin ports (:mod:`waltz.tls`); the HTTP port stays plain.
"""

from waltz.config import (
    ZOOKEEPER_KEYS, Key, bind_address, check_distinct_ports, directory, frame_size, idle_timeout_milliseconds,
    load_config, port, positive_int)
from waltz.tls import SERVES, load_tls, tls_keys

#: The prefix of the storage's TLS keys (its storage and admin ports).
TLS_PREFIX = "storage.ssl."

STORAGE_KEYS = ZOOKEEPER_KEYS + (
    Key("storage.port", port, 55280, "port for Waltz servers (protocol S)"),
    Key("storage.admin.port", port, 55281, "port for admin tools (protocol A)"),
    Key("storage.http.port", port, 55282, "port for /ping, /health and /metrics"),
    Key("storage.bindAddress", bind_address, "0.0.0.0", "IP address the three ports bind to"),
    Key("storage.directory", directory, doc="directory holding the control file and partitions"),
    Key("storage.segment.size.threshold", positive_int, 1_000_000_000,
        "bytes after which a partition rolls to a new segment"),
    Key("storage.segment.cache.capacity", positive_int, 5, "closed segments kept open per partition"),
    Key("storage.maxFrameSize", frame_size, 64 * 1024 * 1024, "largest accepted frame in bytes (at least 16 MiB)"),
    Key("storage.idleTimeout", idle_timeout_milliseconds, 20000,
        "ms without receiving anything (not even a keep-alive) after which a connection is closed"),
) + tls_keys(TLS_PREFIX)

PORT_KEYS = ("storage.port", "storage.admin.port", "storage.http.port")


def load_storage_config(path):
    """Read and validate a storage config file; :class:`ConfigError` names a bad key."""
    config = load_config(path, STORAGE_KEYS)
    check_distinct_ports(config, PORT_KEYS)
    load_tls(config, TLS_PREFIX, SERVES)   # (read again by the service: here it fails before anything starts)
    return config
