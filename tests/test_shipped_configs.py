"""The configs in etc/ (what the systemd units run with) are valid and spell out every key."""

import os

import yaml

from waltz.server.config import SERVER_KEYS, load_server_config
from waltz.storage.config import STORAGE_KEYS, load_storage_config

ETC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "etc")


def keys_in(path):
    with open(path, encoding="utf-8") as f:
        return set(yaml.safe_load(f))


def test_the_server_config_loads_and_names_every_key_but_the_optional_preferences():
    path = os.path.join(ETC, "server.yaml")
    load_server_config(path)
    assert {key.name for key in SERVER_KEYS} - keys_in(path) == {"server.preferredPartitions"}


def test_the_storage_config_loads_and_names_every_key():
    path = os.path.join(ETC, "storage.yaml")
    load_storage_config(path)
    assert {key.name for key in STORAGE_KEYS} - keys_in(path) == set()
