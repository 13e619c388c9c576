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
