"""``waltz client validate``: as a process against a real local cluster, and its checker on wrong input."""

import pytest
from twisted.internet import defer

from tests.cli.helpers import refused, waltz
from waltz.cli.client import _Validator
from waltz.config import expiration_ms


@pytest.mark.timeout(300)
def test_validate_passes_twice_on_a_real_cluster(dev_cluster):
    connect, _ = dev_cluster
    conn = ["--zookeeper", connect, "--root", "/waltz_cluster"]
    for clients in ("2", "3"):   # the second run starts from a log that is not empty
        result = waltz("client", "validate", *conn, "--transactions", "300", "--clients", clients, timeout=200)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "validated 300 transactions" in result.stdout
        assert "every transaction's data equals its id; ids consecutive" in result.stdout


class _Tx:
    def __init__(self, partition_id, transaction_id, data):
        self.partition_id, self.transaction_id, self._data = partition_id, transaction_id, data

    def get_data(self):
        return defer.succeed(self._data)


def test_the_checker_reports_wrong_data_and_gaps():
    problems = []
    validator = _Validator("client 0", 2, problems)
    validator.apply_transaction(_Tx(0, 0, b"0"))
    assert problems == []
    validator.apply_transaction(_Tx(0, 1, b"5"))
    validator.apply_transaction(_Tx(1, 3, b"3"))
    assert problems == ["client 0: partition 0: transaction 1 holds b'5'",
                        "client 0: partition 1: transaction 3 after -1"]


def test_validate_gives_up_on_unserved_partitions_within_its_timeout(serverless_cluster):
    line = refused("client", "validate", *serverless_cluster, "--transactions", "5", "--timeout", "1")
    assert line == ("waltz: error: no high-water mark within 1.0 s for partition(s) 0, 1, 2, 3: not served, or their "
                    "server does not answer")


def test_validate_options_are_checked():
    assert "argument --clients: expected a positive integer, got '0'" in refused(
        "client", "validate", "--clients", "0", code=2)


@pytest.mark.parametrize("timeout, expected", [(15.0, 15000), (90000.0, 86_400_000), (0.0004, 1)])
def test_validates_transactions_expire_within_what_the_key_takes(timeout, expected):
    # Before: --timeout 90000 failed after reading the high-water marks, naming client.transactionExpiration
    # (a key the user never wrote), and --timeout 0.0004 made it 0: never expire.
    assert expiration_ms(timeout) == expected
