"""The ledger job's command line: the cluster from flags or from an application's client config file."""

import pytest

from waltz.spark.jobs.ledger import parse_arguments

pytestmark = pytest.mark.timeout(30)


def test_the_cluster_and_the_client_keys_come_from_a_client_config(tmp_path):
    config = tmp_path / "client.yaml"
    config.write_text("zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /bank\n"
                      "client:\n  ssl:\n    certificate: /pki/client.pem\n    verifyHostname: false\n")
    args = parse_arguments(["--client-config", str(config)])
    assert (args.zookeeper, args.cluster_root) == ("127.0.0.1:2181", "/bank")
    assert args.options == {"client.ssl.certificate": "/pki/client.pem", "client.ssl.verifyHostname": False}
    # Flags win over the file.
    args = parse_arguments(["--client-config", str(config), "--zookeeper", "10.0.0.1:2181", "--cluster-root", "/x"])
    assert (args.zookeeper, args.cluster_root) == ("10.0.0.1:2181", "/x")


def test_flags_alone_still_work():
    args = parse_arguments(["--zookeeper", "127.0.0.1:2181", "--cluster-root", "/bank"])
    assert (args.zookeeper, args.cluster_root, args.options) == ("127.0.0.1:2181", "/bank", {})


@pytest.mark.parametrize("argv, problem", [
    ([], "no zookeeper.connectString given"),
    (["--zookeeper", "127.0.0.1:2181"], "no cluster.root given"),
    (["--client-config", "/nonexistent/client.yaml"], "cannot read config file /nonexistent/client.yaml"),
])
def test_a_missing_cluster_or_an_unreadable_file_is_a_one_line_usage_error(argv, problem, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_arguments(argv)
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err.splitlines()[-1]
