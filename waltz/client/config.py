"""The client's configuration keys and their typed, validated form.

A client config is the ZooKeeper keys every component shares
(``zookeeper.connectString``, ``cluster.root``, ...) plus the ``client.*`` keys
below, with the original's defaults where the original had the key. Times are
milliseconds in the file; :class:`ClientSettings` holds them as seconds (the
unit of the reactor's clock).
"""

import os
from collections.abc import Mapping

import attr

from waltz.config import (
    ZOOKEEPER_KEYS, Config, ConfigError, Key, build_config, idle_timeout_milliseconds, load_config, milliseconds,
    non_negative_int, non_negative_milliseconds, positive_int)
from waltz.tls import CONNECTS, load_tls, tls_keys

#: The ``client.*`` keys (the zookeeper and cluster keys come from :data:`waltz.config.ZOOKEEPER_KEYS`).
CLIENT_ONLY_KEYS = (
    Key("client.autoMount", bool, True,
        "mount every partition at start-up (false: mount only those given to set_partitions)"),
    Key("client.maxConcurrentTransactions", positive_int, 5,
        "appends outstanding per partition; further executes wait"),
    Key("client.longWaitThreshold", milliseconds, 5000,
        "ms without progress on a partition's pending appends before a FLUSH is sent"),
    Key("client.transactionExpiration", non_negative_milliseconds, 60000,
        "ms after its creation a transaction context stops being retried (0: never)"),
    Key("client.maxDataFetchRetries", non_negative_int, 5,
        "re-fetches of transaction data whose checksum does not match, or that the server could not read "
        "right now (after a delay doubling from client.mountRetryInterval)"),
    Key("client.mountRetryInterval", milliseconds, 500,
        "ms to wait before mounting again after a NOT_READY mount response"),
    Key("client.reconnectInitialInterval", milliseconds, 100,
        "ms before the second attempt to reconnect to a server (the first is immediate); at least 1, "
        "since the back-off doubles from it"),
    Key("client.reconnectMaxInterval", milliseconds, 5000,
        "upper bound in ms of the doubling reconnect back-off, which starts over once a connection "
        "has served this long"),
    Key("client.connectTimeout", milliseconds, 10000,
        "ms allowed for a TCP connect to a server, and again for its Hello exchange"),
    Key("client.applyRetryInterval", milliseconds, 100,
        "ms before applyTransaction is called again after it failed (doubles up to 10 s)"),
    Key("client.maxDataRequestsInFlight", positive_int, 256,
        "transaction-data requests outstanding per read_transactions call"),
    Key("client.idleTimeout", idle_timeout_milliseconds, 20000,
        "ms without receiving anything (not even a keep-alive) after which a connection to a server is closed "
        "and opened again"),
)

#: The prefix of the client's TLS keys (``certificate``, ``privateKey``, ``trustRoots``: see :mod:`waltz.tls`).
TLS_PREFIX = "client.ssl."

#: Every key a client config accepts.
CLIENT_KEYS = ZOOKEEPER_KEYS + CLIENT_ONLY_KEYS + tls_keys(TLS_PREFIX)

#: Upper bound of the apply retry back-off, seconds.
MAX_APPLY_RETRY_INTERVAL = 10.0


def _seconds(milliseconds):
    return milliseconds / 1000.0


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClientSettings:
    """The ``client.*`` values the client's components use, times in seconds."""

    auto_mount: bool = True
    max_concurrent_transactions: int = 5
    long_wait_threshold: float = 5.0
    #: ``None`` when contexts never expire.
    transaction_expiration: float = 60.0
    max_data_fetch_retries: int = 5
    mount_retry_interval: float = 0.5
    reconnect_initial_interval: float = 0.1
    reconnect_max_interval: float = 5.0
    connect_timeout: float = 10.0
    apply_retry_interval: float = 0.1
    max_data_requests_in_flight: int = 256
    idle_timeout: float = 20.0

    def retry_later_delay(self, refusals: int) -> float:
        """Seconds before asking again for data the server could not read right now ("try again later"),
        after ``refusals`` such answers: doubling from ``mount_retry_interval``, at most
        :data:`MAX_APPLY_RETRY_INTERVAL`."""
        return min(MAX_APPLY_RETRY_INTERVAL, self.mount_retry_interval * 2 ** (refusals - 1))

    @classmethod
    def from_config(cls, config: Config) -> "ClientSettings":
        """The settings of a validated client :class:`~waltz.config.Config`."""
        expiration = config["client.transactionExpiration"]
        return cls(
            auto_mount=config["client.autoMount"],
            max_concurrent_transactions=config["client.maxConcurrentTransactions"],
            long_wait_threshold=_seconds(config["client.longWaitThreshold"]),
            transaction_expiration=_seconds(expiration) if expiration else None,
            max_data_fetch_retries=config["client.maxDataFetchRetries"],
            mount_retry_interval=_seconds(config["client.mountRetryInterval"]),
            reconnect_initial_interval=_seconds(config["client.reconnectInitialInterval"]),
            reconnect_max_interval=_seconds(config["client.reconnectMaxInterval"]),
            connect_timeout=_seconds(config["client.connectTimeout"]),
            apply_retry_interval=_seconds(config["client.applyRetryInterval"]),
            max_data_requests_in_flight=config["client.maxDataRequestsInFlight"],
            idle_timeout=_seconds(config["client.idleTimeout"]),
        )


def client_config(config) -> Config:
    """A validated client :class:`~waltz.config.Config` from a mapping (dotted or nested keys),
    a YAML file path, or an already built ``Config`` (returned as is)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return _checked(load_config(os.fspath(config), CLIENT_KEYS))
    if isinstance(config, Mapping):
        return _checked(build_config(dict(config), CLIENT_KEYS))
    raise ConfigError("a client config must be a mapping, a YAML file path or a Config, not %s"
                      % type(config).__name__)


def _checked(config):
    """``config``, once its TLS files (if any) were read and found usable: ConfigError names a bad key."""
    load_tls(config, TLS_PREFIX, CONNECTS)
    return config
