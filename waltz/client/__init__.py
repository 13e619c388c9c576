"""The Waltz client library: write transactions to the log, apply the committed ones.

Start with :class:`WaltzClient` (asynchronous, on the Twisted reactor) or
:class:`~waltz.client.blocking.BlockingWaltzClient` (blocking calls, for scripts),
a :class:`TransactionContext` subclass per kind of transaction, and
:class:`WaltzClientCallbacks` (or :class:`~waltz.client.dbapi.DbApiClientCallbacks`
for a SQL database). See ``docs/client.md``.
"""

from waltz.client.api import (
    BytesSerializer, ExecutionResult, IWaltzClientCallbacks, JsonSerializer, Outcome, PartitionLocalLock,
    Transaction, TransactionBuilder, TransactionContext, TransactionRecord, WaltzClientCallbacks)
from waltz.client.client import ClientState, WaltzClient
from waltz.client.config import CLIENT_KEYS, ClientSettings, client_config
from waltz.client.errors import (
    ClientAheadError, ClientClosedError, ContextInFlightError, DataChecksumError, PartitionInactiveError,
    PartitionNotFoundError, ReadError, TransactionDataError, WaltzClientError)
from waltz.client.partition import PartitionState

__all__ = [
    "BytesSerializer", "CLIENT_KEYS", "ClientAheadError", "ClientClosedError", "ClientSettings", "ClientState",
    "ContextInFlightError", "DataChecksumError", "ExecutionResult", "IWaltzClientCallbacks", "JsonSerializer",
    "Outcome", "PartitionInactiveError", "PartitionLocalLock", "PartitionNotFoundError", "PartitionState", "ReadError",
    "Transaction", "TransactionBuilder", "TransactionContext", "TransactionDataError", "TransactionRecord",
    "WaltzClient", "WaltzClientCallbacks", "WaltzClientError", "client_config",
]
