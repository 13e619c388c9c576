"""A demo instance tells the runner how far it got while it catches up with the log."""

from twisted.internet import defer, task

from waltz.demo.instance import PROGRESS_INTERVAL, catch_up


class Client:
    """Two partitions to catch up with: 0 up to 9, 1 up to 4."""

    partitions = frozenset({0, 1})

    def __init__(self):
        self.applied = {0: -1, 1: -1}
        self.waits = {}

    def high_water_marks(self):
        return defer.succeed({0: 9, 1: 4})

    def client_high_water_mark(self, partition_id):
        return self.applied[partition_id]

    def when_applied(self, partition_id, transaction_id):
        self.waits[partition_id] = d = defer.Deferred()
        return d


class Channel:
    def __init__(self):
        self.sent = []

    def send(self, event, **fields):
        self.sent.append((event, fields))


def test_catching_up_reports_the_transactions_applied_until_it_is_done():
    clock, client, channel = task.Clock(), Client(), Channel()
    done = []
    catch_up(client, channel, clock).addCallback(done.append)
    assert channel.sent == [("catching_up", {"applied": 0})]
    client.applied[0] = 5
    clock.advance(PROGRESS_INTERVAL)
    client.applied[0] = 9
    client.waits[0].callback(None)
    clock.advance(PROGRESS_INTERVAL)
    client.applied[1] = 4
    client.waits[1].callback(None)
    assert done == [{0: 9, 1: 4}]
    clock.advance(PROGRESS_INTERVAL * 4)
    assert channel.sent == [("catching_up", {"applied": n}) for n in (0, 6, 10)]
    assert clock.getDelayedCalls() == []
