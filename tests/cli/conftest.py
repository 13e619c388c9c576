"""Fixtures for the ``waltz`` command tests that need a running local cluster."""

import pytest

from tests.cli.helpers import waltz
from waltz.local.daemons import free_port


@pytest.fixture
def dev_cluster(tmp_path):
    """A ``waltz dev`` cluster of this test's own: fires with (connect string, run-dir args); stopped afterwards."""
    port = free_port()
    args = ["--run-dir", str(tmp_path / "dev"), "--zookeeper-port", str(port)]
    up = waltz("dev", "up", *args, timeout=180)
    assert up.returncode == 0, up.stderr
    yield "127.0.0.1:%d" % port, args
    waltz("dev", "down", *args, timeout=120)
