"""Loading YAML config files: every problem is one line naming the file, and the key or the place."""

import pytest

from waltz.client.config import client_config
from waltz.config import ZOOKEEPER_KEYS, ConfigError, flatten, load_config, read_yaml


def written(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_key_given_twice_in_one_mapping_is_refused_naming_key_and_line(tmp_path):
    # PyYAML keeps the last of two equal keys: the first one's value was silently dropped.
    path = written(tmp_path, "storage.port: 1\nstorage.port: 2\n")
    with pytest.raises(ConfigError, match=r"config key 'storage.port' is given twice at line 2, column 1") as raised:
        read_yaml(path)
    assert raised.value.key == "storage.port"
    with pytest.raises(ConfigError, match=r"'port' is given twice at line 3, column 3"):
        read_yaml(written(tmp_path, "storage:\n  port: 1\n  port: 2\n"))


def test_bad_yaml_is_reported_in_one_line_with_its_place(tmp_path):
    with pytest.raises(ConfigError) as raised:
        read_yaml(written(tmp_path, "a: [1, 2\nb: 3\n"))
    message = str(raised.value)
    assert "\n" not in message and "is not valid YAML" in message and "at line 2, column 2" in message


@pytest.mark.parametrize("key, value, least", [("zookeeper.sessionTimeout", 99999999999999, 1000),
                                               ("zookeeper.connectTimeout", 99999999999999, 1),
                                               ("zookeeper.sessionTimeout", 30, 1000)])
def test_millisecond_keys_have_bounds(tmp_path, key, value, least):
    # 10**14 ms passed the checks, then overflowed the reactor's timers at start-up with a misleading error. A
    # session timeout of 30 (meant as seconds) was accepted: the server gave its partitions up at every probe.
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\n%s: %d\n" % (key, value))
    with pytest.raises(ConfigError, match="config key '%s': expected milliseconds from %d to 86400000"
                       % (key, least)):
        load_config(path, ZOOKEEPER_KEYS)


@pytest.mark.parametrize("key, value", [("client.connectTimeout", 86400001), ("client.transactionExpiration", -1),
                                        ("client.reconnectMaxInterval", 10 ** 15)])
def test_client_millisecond_keys_have_bounds(key, value):
    with pytest.raises(ConfigError, match="config key '%s': expected milliseconds" % key):
        client_config({"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/x", key: value})


def test_a_storage_directory_that_is_a_file_is_refused_at_config_time(tmp_path):
    from waltz.storage.config import STORAGE_KEYS
    afile = tmp_path / "afile"
    afile.write_text("x")
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nstorage.directory: %s\n"
                   % afile)
    with pytest.raises(ConfigError, match="config key 'storage.directory': .*afile exists and is not a directory"):
        load_config(path, STORAGE_KEYS)


def test_a_storage_directory_with_a_nul_character_is_refused_at_config_time(tmp_path):
    # It passed, and the daemon died after connecting to ZooKeeper with "embedded null byte", naming no key.
    from waltz.storage.config import STORAGE_KEYS
    path = written(tmp_path, 'zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nstorage.directory: "/tmp/a\\0b"\n')
    with pytest.raises(ConfigError, match="config key 'storage.directory': a path cannot contain a NUL character"):
        load_config(path, STORAGE_KEYS)


@pytest.mark.parametrize("host", ["a b", "", "host/x"])
def test_a_server_host_clients_could_not_reach_is_refused(tmp_path, host):
    from waltz.server.config import SERVER_KEYS
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nserver.host: '%s'\n" % host)
    with pytest.raises(ConfigError, match="config key 'server.host': expected a host name or address"):
        load_config(path, SERVER_KEYS)


def test_a_recursive_yaml_alias_is_refused_naming_the_key(tmp_path):
    # `x: &a {b: *a}` is valid YAML: flattening it recursed until RecursionError (a 40-line traceback from
    # twistd). An alias used twice, not inside itself, is fine.
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nx: &a {b: *a}\n")
    with pytest.raises(ConfigError, match="config key 'x.b' refers to a mapping that contains it"):
        load_config(path, ZOOKEEPER_KEYS)
    assert flatten(read_yaml(written(tmp_path, "a: &x {b: 1}\nc: *x\n"))) == {"a.b": 1, "c.b": 1}


@pytest.mark.parametrize("root", ["/a/../b", "/a/./b", "/.."])
def test_a_cluster_root_with_relative_components_is_refused_naming_the_key(tmp_path, root):
    # Accepted before, then refused by kazoo on every request ("relative paths not allowed", naming nothing).
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: '%s'\n" % root)
    with pytest.raises(ConfigError, match="config key 'cluster.root'"):
        load_config(path, ZOOKEEPER_KEYS)


@pytest.mark.parametrize("size, accepted", [(2 ** 22, True), (2 ** 22 + 1, False), (2 ** 30, False)])
def test_the_lock_table_size_is_bounded_before_any_partition_opens(tmp_path, size, accepted):
    # A table is allocated per partition when it opens, after the ports are bound: a size it could not afford
    # must be refused when the config is read.
    from waltz.server.config import SERVER_KEYS
    path = written(tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\n"
                             "server.optimisticLockTableSize: %d\n" % size)
    if accepted:
        assert load_config(path, SERVER_KEYS)["server.optimisticLockTableSize"] == size
    else:
        with pytest.raises(ConfigError, match="config key 'server.optimisticLockTableSize': expected at most "
                                              "4194304 slots per partition"):
            load_config(path, SERVER_KEYS)


@pytest.mark.parametrize("key", ["server.idleTimeout", "storage.idleTimeout", "client.idleTimeout"])
def test_an_idle_timeout_shorter_than_three_keep_alive_intervals_is_refused_naming_the_key(tmp_path, key):
    from waltz.client.config import CLIENT_KEYS
    from waltz.server.config import SERVER_KEYS
    from waltz.storage.config import STORAGE_KEYS
    keys = {"server": SERVER_KEYS, "storage": STORAGE_KEYS, "client": CLIENT_KEYS}[key.split(".")[0]]
    base = "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\n"
    if key.startswith("storage"):
        base += "storage.directory: %s\n" % tmp_path
    assert load_config(written(tmp_path, base), keys)[key] == 20000
    assert load_config(written(tmp_path, base + "%s: 60000\n" % key), keys)[key] == 60000
    with pytest.raises(ConfigError, match="config key '%s': expected milliseconds from 15000" % key):
        load_config(written(tmp_path, base + "%s: 10000\n" % key), keys)


def test_the_daemons_apply_their_idle_timeout_to_every_connection(tmp_path):
    from twisted.internet.testing import MemoryReactorClock

    from waltz.server.config import SERVER_KEYS, check_server_config
    from waltz.server.service import WaltzServerService
    from waltz.storage.config import load_storage_config
    from waltz.storage.tap import StorageService
    reactor = MemoryReactorClock()
    server = WaltzServerService(check_server_config(load_config(written(
        tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nserver.idleTimeout: 45000\n"),
        SERVER_KEYS)), reactor)
    assert server.liveness.idle_timeout == 45.0
    storage = StorageService(load_storage_config(written(
        tmp_path, "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /x\nstorage.directory: %s\n"
                  "storage.idleTimeout: 50000\n" % (tmp_path / "data"))), reactor)
    storage._listen()
    factories = [port.args[1] for port in storage.ports[:2]]
    assert [factory.liveness.idle_timeout for factory in factories] == [50.0, 50.0]


@pytest.mark.parametrize("value, message", [
    (70000, "config key 'storage.port': expected a port number 1-65535, got 70000"),
    ("abc", "config key 'storage.port': expected an integer (got 'abc')"),
])
def test_a_bad_value_is_named_once_in_plain_words(value, message):
    # Was "... got 70000 (got 70000)" and "invalid literal for int() with base 10: 'abc' (got 'abc')".
    from waltz.config import build_config
    from waltz.storage.config import STORAGE_KEYS
    with pytest.raises(ConfigError) as caught:
        build_config({"storage.port": value, "storage.directory": "/tmp/waltz", "zookeeper.connectString": "h:1",
                      "cluster.root": "/w"}, STORAGE_KEYS)
    assert str(caught.value) == message


def test_a_key_written_with_no_value_is_refused_naming_it(tmp_path):
    # Was taken for the default, silently (a storage bound its default port).
    from waltz.storage.config import load_storage_config
    path = tmp_path / "storage.yaml"
    path.write_text("zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /w\nstorage.directory: /tmp/w\n"
                    "storage:\n  port:\n")
    with pytest.raises(ConfigError) as caught:
        load_storage_config(str(path))
    assert caught.value.key == "storage.port" and "has no value" in str(caught.value)
