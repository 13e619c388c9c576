"""How many large reads one connection may have running: :class:`ReadGate`.

A peer may pipeline many read requests whose answers are large: a Waltz client's transaction-data
requests (``client.maxDataRequestsInFlight``, 256 by default, each answer up to 4 MiB for a batch
or 15 MiB for one transaction), a server's record list requests to a storage node (up to 8 MiB
each). A connection stops *reading* requests while the peer does not read its answers, but the
answers of reads already started are still written into the transport's buffer: with every
request read in one go started at once, a slow reader made the server buffer a gigabyte, and a
storage node could buffer 600 record lists. So a connection starts at most
:data:`MAX_READS_IN_FLIGHT` such reads at a time, and none while it is not writable; the requests
waiting for their turn count toward the connection's inbound back pressure (their Deferreds are
pending), which stops reading from it once enough wait.
"""

from collections import deque

from twisted.internet import defer

#: Reads one connection may have started and not answered yet.
MAX_READS_IN_FLIGHT = 32


class ReadGate:
    """Admits the large reads of one connection (see the module docstring).

    ``connection`` has ``writable`` and ``closed``; its owner calls :meth:`wake` when it becomes
    writable again or closes.
    """

    def __init__(self, connection, limit=MAX_READS_IN_FLIGHT):
        self._connection = connection
        self._limit = limit
        self._running = 0
        self._waiting = deque()     # (read, Deferred) in arrival order
        self._admitting = False

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self, read):
        """Call ``read()`` (which starts a read and answers it; it may return a Deferred) when its turn
        comes; the Deferred returned fires with its result, or with None without calling it if the
        connection closed first."""
        done = defer.Deferred()
        self._waiting.append((read, done))
        self._admit()
        return done

    def wake(self):
        """The connection became writable, or closed: admit what waits."""
        self._admit()

    def _admit(self):
        # Not re-entered: a read that ends at once (the store has no session during an outage) calls
        # _ended from inside this loop, and admitting the next one from there would nest one level per
        # waiting request, past the recursion limit with a few hundred waiting. The loop admits it instead.
        if self._admitting:
            return
        self._admitting = True
        try:
            # One loop, the connection looked at before each request: a read may close it (its owner's
            # wake, re-entering, is a no-op), and what waits is then dropped here.
            while self._waiting:
                if self._connection.closed:
                    self._waiting.popleft()[1].callback(None)
                elif self._running < self._limit and self._connection.writable:
                    read, done = self._waiting.popleft()
                    self._running += 1
                    defer.maybeDeferred(read).addBoth(self._ended).chainDeferred(done)
                else:
                    break
        finally:
            self._admitting = False

    def _ended(self, result):
        self._running -= 1
        self._admit()
        return result
