"""The configs in etc/ (what the systemd units run with) are valid and spell out every key."""

import os

import yaml

from waltz.server.config import SERVER_KEYS, load_server_config
from waltz.storage.config import STORAGE_KEYS, load_storage_config

ETC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "etc")


def keys_in(path):
    with open(path, encoding="utf-8") as f:
        return set(yaml.safe_load(f))


def commented_keys_in(path):
    """The keys shown commented out (``# key: value``): optional ones, without a default."""
    with open(path, encoding="utf-8") as f:
        return {line[2:].split(":")[0] for line in f if line.startswith("# ") and ": " in line
                and " " not in line[2:].split(":")[0]}


def tls_keys_named(prefixes):
    return {prefix + suffix for prefix in prefixes
            for suffix in ("certificate", "privateKey", "trustRoots", "verifyHostname")}


def test_the_server_config_loads_and_names_every_key_but_the_optional_preferences_and_tls():
    path = os.path.join(ETC, "server.yaml")
    load_server_config(path)
    optional = {"server.preferredPartitions"} | tls_keys_named(("server.ssl.", "storage.ssl."))
    assert {key.name for key in SERVER_KEYS} - keys_in(path) == optional
    assert optional <= commented_keys_in(path)


def test_the_storage_config_loads_and_names_every_key_but_tls():
    path = os.path.join(ETC, "storage.yaml")
    load_storage_config(path)
    optional = tls_keys_named(("storage.ssl.",))
    assert {key.name for key in STORAGE_KEYS} - keys_in(path) == optional
    assert optional <= commented_keys_in(path)
