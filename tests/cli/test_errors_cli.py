"""Every failure of the ``waltz`` command is one line on stderr: the option types reject bad values in argparse,
and :func:`waltz.cli.main.main` reports any exception a command raises in one line (with its traceback only
under WALTZ_DEBUG)."""

import argparse

import pytest

from tests.cli.helpers import refused
from waltz.cli import disk, main
from waltz.cli.common import CliError, milliseconds, port, positive_int, positive_seconds
from waltz.local.daemons import DaemonError
from waltz.local.zookeeper import ZooKeeperLaunchError
from waltz.zk.errors import ClusterNotFoundError, ZooKeeperConnectError


@pytest.mark.parametrize("parse, good, bad", [
    (positive_seconds, [("0.5", 0.5), ("30", 30.0)], ["0", "-1", "nan", "inf", "soon", "1e12"]),
    (milliseconds, [("1", 1), ("86400000", 86400000)], ["0", "-1", "86400001", "99999999999999", "1.5"]),
    (positive_int, [("1", 1), ("70000", 70000)], ["0", "-3", "1.5", "many"]),
    (port, [("1", 1), ("65535", 65535)], ["0", "65536", "70000", "-1", "http"]),
])
def test_option_types(parse, good, bad):
    for text, value in good:
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            parse(text)


@pytest.mark.parametrize("argv, message", [
    (["dev", "up", "--partitions", "0"], "argument --partitions: expected a partition count from 1 to 10000, got '0'"),
    # A mistyped count used to create znodes until ZooKeeper ran out of memory.
    (["cluster", "create", "-n", "a", "-p", "99999999999"],
     "argument --partitions/-p: expected a partition count from 1 to 10000, got '99999999999'"),
    (["cluster", "create", "-n", "a", "-p", "10001"], "argument --partitions/-p: expected a partition count"),
    (["dev", "status", "--zookeeper-port", "70000"], "argument --zookeeper-port: expected a port number"),
    (["zookeeper", "start", "--port", "70000"], "argument --port: expected a port number 1-65535, got '70000'"),
    (["zookeeper", "stop", "--timeout", "-1"], "argument --timeout: expected a positive number of seconds"),
    (["client", "validate", "--clients", "0"], "argument --clients: expected a positive integer, got '0'"),
    (["client", "validate", "--timeout", "0"], "argument --timeout: expected a positive number of seconds"),
    (["client", "high-water-mark", "--timeout", "-5"], "argument --timeout: expected a positive number of seconds"),
    (["perf", "producers", "--lock-range", "0"], "argument --lock-range: expected a positive integer, got '0'"),
    (["perf", "producers", "--timeout", "0"], "argument --timeout: expected a positive number of seconds"),
    (["perf", "producers", "--size", "20000000"], "argument --size: expected at most 15728640 bytes (15 MiB"),
    (["cluster", "create", "-n", " ", "-p", "2"], "argument --name/-n: expected a name, got ' '"),
    (["perf", "consumers", "--timeout", "-1"], "argument --timeout: expected a positive number of seconds"),
    (["cluster", "verify", "--timeout", "-1"], "argument --timeout: expected a positive number of seconds"),
    (["cluster", "assign", "-s", "a:1", "-p", "0", "--lock-timeout", "0"],
     "argument --lock-timeout: expected a positive number of seconds"),
    (["cluster", "add-storage", "-s", "a:1", "-a", "70000", "-g", "0"], "argument --admin-port/-a: expected a port"),
    (["cluster", "show", "--connect-timeout", "-1"], "argument --connect-timeout: expected milliseconds from 1"),
    (["cluster", "show", "--connect-timeout", "99999999999999"],
     "argument --connect-timeout: expected milliseconds from 1 to 86400000 (a day)"),
    (["server", "list", "--timeout", "0"], "argument --timeout: expected a positive number of seconds"),
    (["storage", "list", "--timeout", "0"], "argument --timeout: expected a positive number of seconds"),
    (["demo", "--duration", "0"], "argument --duration: expected a positive number of seconds"),
    (["smoke", "--fault-interval", "-4"], "argument --fault-interval: expected a positive number of seconds"),
    # These exited 1 with the config key's message (one a bare int() error), after parsing.
    (["cluster", "show", "--zookeeper", "127.0.0.1:70000", "--root", "/w"],
     "argument --zookeeper: expected a ZooKeeper connect string"),
    (["storage", "list", "--zookeeper", "127.0.0.1:abc", "--root", "/w"],
     "argument --zookeeper: expected a ZooKeeper connect string"),
    (["server", "list", "--zookeeper", "127.0.0.1:2181", "--root", "waltz_cluster"],
     "argument --root: expected an absolute znode path like /waltz_cluster, got 'waltz_cluster'"),
])
def test_bad_option_values_are_usage_errors(argv, message):
    with pytest.raises(CliError) as raised:
        main.build_parser().parse_args(argv)
    assert raised.value.exit_code == 2
    assert message in str(raised.value)


@pytest.mark.parametrize("error, line", [
    (ClusterNotFoundError("no Waltz cluster at /x: znode /x does not exist"),
     "no Waltz cluster at /x: znode /x does not exist"),
    (ZooKeeperConnectError("cannot connect to ZooKeeper at 127.0.0.1:1 within 300 ms; is it running?"),
     "cannot connect to ZooKeeper at 127.0.0.1:1 within 300 ms; is it running?"),
    (FileNotFoundError(2, "No such file or directory", "/data/0"), "/data/0: No such file or directory"),
    (PermissionError(13, "Permission denied"), "Permission denied"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
     "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    (DaemonError("storage exited with status 1:\nTraceback (most recent call last):\n..."),
     "storage exited with status 1:"),
    (ZooKeeperLaunchError("port 2181 on 127.0.0.1 is already in use\nmore"),
     "port 2181 on 127.0.0.1 is already in use"),
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero"),
    (KeyError("partition"), "KeyError: 'partition'"),
])
def test_any_error_of_a_command_is_one_line(monkeypatch, capsys, error, line):
    monkeypatch.delenv("WALTZ_DEBUG", raising=False)
    stderr = _run_failing_command(monkeypatch, capsys, error)
    assert stderr == "waltz: error: %s\n" % line


def test_waltz_debug_adds_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("WALTZ_DEBUG", "1")
    stderr = _run_failing_command(monkeypatch, capsys, ZeroDivisionError("division by zero"))
    assert stderr.startswith("Traceback (most recent call last):\n")
    assert "in failing_command" in stderr
    assert stderr.endswith("ZeroDivisionError: division by zero\nwaltz: error: ZeroDivisionError: division by zero\n")


def _run_failing_command(monkeypatch, capsys, error):
    """Run ``waltz disk segment-stats`` whose function raises ``error``; returns stderr."""
    def failing_command(args):
        raise error
    monkeypatch.setattr(disk, "run_segment_stats", failing_command)
    with pytest.raises(SystemExit) as exited:
        main.main(["disk", "segment-stats", "--dir", "/nowhere"])
    assert exited.value.code == 1
    out, err = capsys.readouterr()
    assert out == ""
    return err


def test_a_config_file_that_is_not_text_is_one_line(tmp_path):
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    assert refused("cluster", "show", "-c", str(binary)).startswith(
        "waltz: error: config file %s is not UTF-8 text: " % binary)


def test_demo_check_of_a_missing_run_is_one_line(tmp_path):
    missing = tmp_path / "missing"
    assert refused("demo", "--check", str(missing)) == (
        "waltz: error: cannot read the demo run in %s: %s: No such file or directory" % (missing, missing))
    (tmp_path / "run" / "instance-1").mkdir(parents=True)
    assert refused("demo", "--check", str(tmp_path / "run")) == (
        "waltz: error: cannot read the demo run in %s: %s: No such file or directory"
        % (tmp_path / "run", tmp_path / "run" / "instance-1" / "report.json"))


def test_too_few_smoke_transactions_is_a_usage_error():
    assert "argument --transactions: must be at least 2" in refused("smoke", "--transactions", "1", code=2)


def test_dev_commands_use_the_run_directorys_zookeeper_port(tmp_path):
    from waltz.local.devcluster import DEFAULT_ZOOKEEPER_PORT, DevCluster
    assert DevCluster(str(tmp_path), None).zookeeper.port == DEFAULT_ZOOKEEPER_PORT
    (tmp_path / "zookeeper").mkdir()
    (tmp_path / "zookeeper" / "zoo.cfg").write_text("clientPort=47281\n")
    assert DevCluster(str(tmp_path), None).zookeeper.port == 47281        # 'dev status' after 'dev up --zookeeper-port'
    assert DevCluster(str(tmp_path), 40000).zookeeper.port == 40000


def test_a_bad_tls_file_in_the_config_is_one_line_naming_the_key(tmp_path):
    from waltz.local.pki import LocalPKI
    keys = LocalPKI(str(tmp_path / "pki")).keys("ssl.", "operator")
    del keys["ssl.trustRoots"]
    config = tmp_path / "cli.yaml"
    config.write_text("zookeeper.connectString: 127.0.0.1:1\ncluster.root: /waltz\n"
                      + "".join("%s: %s\n" % item for item in keys.items()))
    line = refused("storage", "list", "-c", str(config))
    assert "config key 'ssl.trustRoots' is required when 'ssl.certificate' is set" in line
