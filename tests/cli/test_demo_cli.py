"""``waltz demo`` as a process on a real local cluster: instances, faults, and the final checks."""

import os
import re
import sqlite3

import pytest

from tests.cli.helpers import refused, waltz


@pytest.mark.timeout(240)
def test_the_demo_moves_money_through_faults_and_proves_nothing_was_lost(dev_cluster):
    connect, args = dev_cluster
    result = waltz("demo", *args, "--instances", "2", "--accounts", "6", "--duration", "16", timeout=220)
    out = result.stdout
    assert result.returncode == 0, (out, result.stderr)
    assert re.search(r"fault: storage-1 \(pid \d+\) killed with SIGKILL", out), out
    assert re.search(r"fault: server-\d \(pid \d+, holding partitions [\d,]+\) killed with SIGKILL", out), out
    assert "fault: storage-1 restarted" in out and re.search(r"fault: server-\d restarted", out)
    committed = int(re.search(r"demo: (\d+) transactions committed", out).group(1))
    assert committed > 0
    assert re.search(r"\[ok\] every committed transaction applied exactly once by every instance "
                     r"\(%d committed in this run" % committed, out), out
    assert "[ok] no account went negative, no withdrawal after a deactivation" in out
    assert "[ok] all instances' databases agree" in out
    assert out.rstrip().splitlines()[-1].startswith("demo: all checks passed")

    # The checks read the instances' databases: a tampered one fails them.
    run_dir = re.search(r"databases and logs in (\S+)", out).group(1)
    assert waltz("demo", "--check", run_dir).returncode == 0
    connection = sqlite3.connect(os.path.join(run_dir, "instance-1", "bank.db"))
    connection.execute("UPDATE accounts SET balance = balance + 1 WHERE account = "
                       "(SELECT MIN(account) FROM accounts)")
    connection.commit()
    connection.close()
    tampered = waltz("demo", "--check", run_dir)
    assert tampered.returncode == 1
    assert "[FAILED] all instances' databases agree" in tampered.stdout
    assert "instance-1: accounts table differs from the replay of its ledger" in tampered.stdout


def test_demo_option_errors_are_one_line():
    assert "argument --instances: expected a positive integer, got '0'" in refused("demo", "--instances", "0", code=2)
    assert "argument --duration: expected a positive number of seconds up to 31622400, got '0'" in refused(
        "demo", "--duration", "0", code=2)
    assert "argument --root: expected an absolute znode path" in refused("demo", "--root", "relative", code=2)
    assert "argument --accounts: expected a number of accounts from 1 to 1000, got '1001'" in refused(
        "demo", "--accounts", "1001", code=2)
