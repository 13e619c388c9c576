"""The application-facing classes: locks, builder, serializers, Transaction, config."""

import types

import pytest
from twisted.internet import defer
from zope.interface.verify import verifyObject

from waltz.client.api import (
    IWaltzClientCallbacks, JsonSerializer, PartitionLocalLock, Transaction, TransactionBuilder,
    WaltzClientCallbacks, lock_hashes)
from waltz.client.config import CLIENT_KEYS, ClientSettings, client_config
from waltz.config import ConfigError
from waltz.protocols import client_messages as m
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId, checksum

RID = ReqId(1, 2, 3, 4)


def test_lock_hash_of_a_partition_local_lock_follows_the_contract():
    lock = PartitionLocalLock("account", 42)
    assert lock.hash == lock_hash("account", 42)
    # CRC32C over UTF-8 name and the 8-byte big-endian id, as a signed int
    assert lock.hash == checksum(b"account" + (42).to_bytes(8, "big"))
    assert lock_hashes([("account", 42), lock]) == (lock.hash, lock.hash)
    assert PartitionLocalLock("account", 43).hash != lock.hash


def test_builder_builds_the_append_request():
    builder = TransactionBuilder(RID, 17)
    builder.set_header(-5)
    builder.set_transaction_data({"amount": 3}, JsonSerializer())
    builder.set_write_locks([("account", 1)])
    builder.set_read_locks([PartitionLocalLock("customer", 2)])
    builder.set_append_locks([("ledger", 3)])
    request = builder.build_request()
    assert request == m.AppendRequest(RID, 17, (lock_hash("account", 1),), (lock_hash("customer", 2),),
                                      (lock_hash("ledger", 3),), -5, b'{"amount":3}', checksum(b'{"amount":3}'))
    # and it encodes (the checksum verifies on decode)
    assert m.CLIENT_CODEC.decode(m.CLIENT_CODEC.encode(request, 4), 4) == request


def test_builder_defaults_and_checks():
    builder = TransactionBuilder(RID, -1)
    assert builder.build_request().data == b"" and builder.build_request().write_locks == ()
    with pytest.raises(TypeError):
        builder.set_transaction_data("text")      # bytes unless a serializer is given
    builder.set_transaction_data("text", lambda s: s.encode())
    assert builder.data == b"text"
    with pytest.raises(TypeError):
        builder.set_transaction_data(1, lambda v: v)
    with pytest.raises(ValueError):
        builder.set_header(2 ** 31)


def test_transaction_get_data_deserializes():
    class Reader:
        def fetch_data(self, transaction_id):
            return defer.succeed(b'{"n":%d}' % transaction_id)
    transaction = Transaction(0, 5, 1, RID, Reader())
    assert transaction.get_data().result == b'{"n":5}'
    assert transaction.get_data(JsonSerializer()).result == {"n": 5}
    assert transaction == Transaction(0, 5, 1, RID, None)


def test_callbacks_base_class_provides_the_interface():
    assert verifyObject(IWaltzClientCallbacks, WaltzClientCallbacks())


def test_client_config_defaults_follow_the_reference():
    config = client_config({"zookeeper": {"connectString": "h:2181"}, "cluster.root": "/c"})
    settings = ClientSettings.from_config(config)
    assert settings.max_concurrent_transactions == 5
    assert settings.long_wait_threshold == 5.0
    assert settings.auto_mount is True
    assert settings.max_data_fetch_retries == 5
    assert settings.mount_retry_interval == 0.5
    assert settings.transaction_expiration == 60.0
    assert ClientSettings.from_config(client_config(
        {"zookeeper.connectString": "h:1", "cluster.root": "/c", "client.transactionExpiration": 0})
    ).transaction_expiration is None
    assert {k.name for k in CLIENT_KEYS} >= {"client.autoMount", "client.longWaitThreshold",
                                             "client.maxConcurrentTransactions"}


def test_client_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="client.maxConcurrentTransactions"):
        client_config({"zookeeper.connectString": "h:1", "cluster.root": "/c",
                       "client.maxConcurrentTransactions": 0})
    with pytest.raises(ConfigError, match="client.bogus"):
        client_config({"zookeeper.connectString": "h:1", "cluster.root": "/c", "client.bogus": 1})
    path = tmp_path / "client.yaml"
    path.write_text("zookeeper.connectString: h:1\ncluster.root: /c\nclient.autoMount: false\n")
    assert client_config(str(path))["client.autoMount"] is False
    assert client_config(path)["client.autoMount"] is False                    # a pathlib.Path too
    frozen = types.MappingProxyType({"zookeeper.connectString": "h:1", "cluster.root": "/c"})
    assert client_config(frozen)["cluster.root"] == "/c"                       # any mapping
    with pytest.raises(ConfigError, match="must be a mapping, a YAML file path or a Config, not list"):
        client_config([("cluster.root", "/c")])


def test_the_builder_refuses_data_over_the_transaction_limit():
    from waltz.protocols.framing import MAX_TRANSACTION_DATA_SIZE
    builder = TransactionBuilder(ReqId(1, 1, 0, 1), -1)
    builder.set_transaction_data(b"x" * MAX_TRANSACTION_DATA_SIZE)
    assert len(builder.build_request().data) == MAX_TRANSACTION_DATA_SIZE
    builder.set_transaction_data(b"x" * (MAX_TRANSACTION_DATA_SIZE + 1))
    with pytest.raises(ValueError, match="over the limit of 15728640 bytes"):
        builder.build_request()


@pytest.mark.parametrize("setter", ["set_write_locks", "set_read_locks", "set_append_locks"])
def test_the_builder_refuses_locks_over_the_limit(setter):
    from waltz.protocols.locks import MAX_LOCKS_PER_KIND
    builder = TransactionBuilder(ReqId(1, 1, 0, 1), -1)
    getattr(builder, setter)([("k", i) for i in range(MAX_LOCKS_PER_KIND)])
    with pytest.raises(ValueError, match="%d %s locks are over the limit of %d per transaction"
                       % (MAX_LOCKS_PER_KIND + 1, setter.split("_")[1], MAX_LOCKS_PER_KIND)):
        getattr(builder, setter)([("k", i) for i in range(MAX_LOCKS_PER_KIND + 1)])
