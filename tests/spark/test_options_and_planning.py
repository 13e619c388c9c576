"""Option parsing, range planning and the server's batched-read helpers, without a cluster."""

import pytest
from twisted.internet import defer

from waltz.protocols import client_messages as L
from waltz.protocols.values import Record, ReqId
from waltz.server.partition import BatchReadError, batch_request_problem, id_runs, read_record_batch
from waltz.spark.options import EARLIEST, LATEST, OptionError, TransactionIdSpec, parse_options
from waltz.spark.planning import (
    WaltzSplit, initial_offsets, plan_ranges, plan_splits, stream_ranges)

BASE = {"zookeeper": "127.0.0.1:2181", "cluster.root": "/c"}


def options(**extra):
    return parse_options({**BASE, **extra})


def test_defaults_and_case_insensitive_keys():
    parsed = parse_options({"ZooKeeper": "127.0.0.1:2181", "CLUSTER.ROOT": "/c", "client.maxdatarequestsinflight": "4",
                            "path": "ignored"})
    assert parsed.partitions is None and parsed.headers is None and parsed.include_data
    assert parsed.starting == TransactionIdSpec(EARLIEST) and parsed.ending == TransactionIdSpec(LATEST)
    assert parsed.client_config()["client.maxDataRequestsInFlight"] == "4"


@pytest.mark.parametrize("extra,option", [
    ({"partitions": "3-1"}, "partitions"), ({"partitions": "x"}, "partitions"),
    ({"startingTransactionIds": "[1]"}, "startingTransactionIds"),
    ({"startingTransactionIds": '{"0": -3}'}, "startingTransactionIds"),
    ({"endingTransactionIds": '{"0": -2}'}, "endingTransactionIds"),
    ({"headers": "1,a"}, "headers"), ({"includeRequestId": "2"}, "includeRequestId"),
    ({"timeout": "-1"}, "timeout"), ({"cluster.root": ""}, "cluster.root"),
    ({"timeout": "inf"}, "timeout"), ({"timeout": "nan"}, "timeout"), ({"timeout": "1e300"}, "timeout"),
    ({"startingTransactionId": "earliest"}, "startingtransactionid"),        # misspelled: not ignored
    ({"startingOffsets": "earliest"}, "startingoffsets"),                    # Kafka's name
    ({"cluster.root": "no-slash"}, "cluster.root"),
    ({"zookeeper.sessionTimeout": "x"}, "zookeeper.sessionTimeout"),
    # Given but empty: read everything before (a list joined from an empty selection).
    ({"headers": ""}, "headers"), ({"partitions": " "}, "partitions"),
    ({"startingTransactionIds": ""}, "startingTransactionIds"),
    ({"startingTransactionIds": '{"0": 5, "00": 7}'}, "startingTransactionIds"),   # one partition twice
    ({"partitions": "0-20000000"}, "partitions"),    # beyond any cluster: built 20 million ids first
    ({"client.autoMount": "true"}, "client.autoMount"),     # taken, then overridden without a word
])
def test_bad_options_name_the_option(extra, option):
    with pytest.raises(OptionError, match="option '%s'" % option):
        options(**extra)


def test_the_connect_string_given_twice_must_agree():
    # Two different ensembles given: the first spelling won, silently.
    with pytest.raises(OptionError, match="option 'zookeeper': is given twice.*'127.0.0.1:2181'.*'127.0.0.1:2182'"):
        options(**{"zookeeper.connectString": "127.0.0.1:2182"})
    both = options(**{"zookeeper.connectString": "127.0.0.1:2181"})
    alone = parse_options({"zookeeper.connectString": "127.0.0.1:2182", "cluster.root": "/c"})
    assert both.zookeeper == "127.0.0.1:2181" and alone.zookeeper == "127.0.0.1:2182"
    with pytest.raises(OptionError, match="option 'zookeeper': is empty"):     # was taken as not given
        parse_options({"zookeeper": " ", "zookeeper.connectString": "127.0.0.1:2182", "cluster.root": "/c"})


def test_a_negative_partition_key_is_named_as_such():
    # The message said the transaction id was wrong.
    with pytest.raises(OptionError, match="'-1' is not a partition id"):
        options(startingTransactionIds='{"-1": 5}')


@pytest.mark.parametrize("name", ["bank.db", "bank#1.db", "bank?x.db", "bank%41.db"])
def test_the_ledger_job_reads_an_accounts_file_whatever_its_name(tmp_path, name):
    # "file:%s?mode=ro" % path: '#' cut the path (and a file "bank" was created), '?' and '%' mangled it.
    import sqlite3
    from waltz.spark.jobs import ledger

    class Spark:
        def createDataFrame(self, rows, schema):
            return rows
    path = tmp_path / name
    with sqlite3.connect(str(path)) as db:
        db.execute("CREATE TABLE accounts (account INTEGER, balance INTEGER, active INTEGER)")
        db.execute("INSERT INTO accounts VALUES (1, 50, 1)")
    assert ledger.read_sqlite_accounts(Spark(), str(path)) == [(1, 50, True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_ranges_resolve_earliest_latest_and_per_partition_ids():
    marks = {0: 99, 1: 9, 2: -1}
    assert plan_ranges(options(), 3, marks) == {0: (0, 99), 1: (0, 9), 2: (0, -1)}
    spec = options(partitions="0,1", startingTransactionIds='{"0": 50, "1": -1}', endingTransactionIds='{"0": 60}')
    assert plan_ranges(spec, 3, marks) == {0: (50, 60), 1: (10, 9)}
    with pytest.raises(OptionError, match="transaction 100 is not committed"):
        plan_ranges(options(endingTransactionIds='{"0": 100}'), 3, marks)
    with pytest.raises(OptionError, match="ends at transaction 5, before it starts at 50"):
        plan_ranges(options(startingTransactionIds='{"0": 50}', endingTransactionIds='{"0": 5}'), 3, marks)
    with pytest.raises(OptionError, match="partition 3 does not exist"):
        plan_ranges(options(partitions="3"), 3, marks)


def test_splits_cut_ranges_and_stream_offsets_are_high_water_marks():
    assert plan_splits({0: (0, 24), 1: (5, 4)}, 10) == [WaltzSplit(0, 0, 9), WaltzSplit(0, 10, 19),
                                                        WaltzSplit(0, 20, 24)]
    assert initial_offsets(options(startingTransactionIds='{"1": -1, "0": 2}'), 2, {0: 7, 1: 7}) == {
        "0": 1, "1": "latest"}
    assert stream_ranges({"0": -1, "1": 7}, {"0": 3, "1": 9}) == {0: (0, 3), 1: (8, 9)}
    assert stream_ranges({"0": -1, "1": "latest"}, {"0": 3, "1": 9}) == {0: (0, 3), 1: (10, 9)}


def test_batch_messages_need_version_5():
    request = L.TransactionDataBatchRequest(ReqId(1, 2, 3, 4), [7, 8])
    assert L.CLIENT_CODEC.decode(L.CLIENT_CODEC.encode(request, 5), 5) == request
    with pytest.raises(ValueError, match="version 5"):
        L.CLIENT_CODEC.encode(request, 4)


def test_batch_requests_are_checked_and_read_in_runs():
    assert batch_request_problem([], 0, 9) and batch_request_problem([3, 2], 0, 9)
    assert "not committed" in batch_request_problem([1, 10], 0, 9)
    assert batch_request_problem([0, 5, 9], 0, 9) is None
    assert id_runs([1, 2, 3, 7, 9, 10]) == [(1, 3), (7, 1), (9, 2)]

    class Store:
        def __init__(self, records):
            self.records, self.calls = records, []

        def get_records(self, first, count):
            self.calls.append((first, count))
            return defer.succeed(tuple(r for r in self.records if first <= r.transaction_id)[:min(count, 2)])

    rid = ReqId(1, 1, 0, 1)
    records = [Record.create(i, rid, 0, b"x" * 10) for i in range(6)]
    store = Store(records)
    got = []
    read_record_batch(store, [0, 1, 2, 4], 0, 1 << 20).addCallback(got.append)
    assert got == [[records[0], records[1], records[2], records[4]]]
    assert store.calls == [(0, 3), (2, 1), (4, 1)]
    got = []
    read_record_batch(Store(records), [0, 1, 2, 3], 0, 25).addCallback(got.append)
    assert got == [records[:2]]          # no more than the byte budget, even within one storage answer
    got = []
    read_record_batch(Store(records), [0, 1, 2, 3], 0, 5).addCallback(got.append)
    assert got == [records[:1]]          # at least one record, however large
    bad = Store([records[0], Record(1, rid, 0, b"y", records[1].checksum)])
    failures = []
    read_record_batch(bad, [0, 1], 0, 1 << 20).addErrback(failures.append)
    assert failures[0].check(BatchReadError) and "transaction 1 of partition 0 failed its checksum" in str(
        failures[0].value)
