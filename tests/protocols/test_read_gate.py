"""ReadGate on its own: admission in order, at most the limit, none while unwritable or after a close."""

from types import SimpleNamespace

from twisted.internet import defer

from waltz.protocols.read_gate import ReadGate


def connection():
    return SimpleNamespace(writable=True, closed=False)


def test_reads_are_admitted_in_order_up_to_the_limit():
    conn, started = connection(), []
    gate = ReadGate(conn, limit=2)
    held = [defer.Deferred() for _ in range(4)]
    results = [gate.run(lambda n=n: started.append(n) or held[n]) for n in range(4)]
    assert started == [0, 1] and gate.waiting == 2
    held[0].callback("a")
    assert started == [0, 1, 2] and results[0].result == "a"


def test_a_read_that_closes_the_connection_drops_the_reads_waiting_behind_it():
    # A read ending at once that closes the connection (a handler error): the loop, no longer re-entered,
    # kept starting the waiting reads; and the owner's wake on close, made from inside the loop, was lost.
    conn, started = connection(), []

    def closing(n):
        started.append(n)
        conn.closed = True
        return defer.succeed(n)
    gate = ReadGate(conn, limit=1)
    conn.writable = False
    results = [gate.run(lambda n=n: closing(n)) for n in range(5)]
    conn.writable = True
    gate.wake()
    assert started == [0]
    assert [d.result for d in results] == [0, None, None, None, None] and gate.waiting == 0
