"""A mutex held as one ephemeral znode, compatible with the original's admin lock.

The original (zktools ``ZooKeeperClientImpl.mutex``) takes the lock by creating
an *ephemeral* znode at the lock path; whoever finds it already there watches it
and tries again once it is deleted. Because the znode is ephemeral, a holder
that dies releases the lock when its session ends. Waltz uses it at
``<root>/store/adminLock`` so that admin edits of the store znodes never
interleave. (Kazoo's ``Lock`` recipe uses sequential children instead, which
the original would not see, so it is not used here.)
"""

import os

from kazoo.exceptions import ConnectionLoss, NodeExistsError, NoNodeError
from twisted.internet import defer

from waltz.zk.errors import LockTimeoutError, swallow


class ZnodeMutex:
    """The mutex at ``path`` over a connected :class:`~waltz.zk.bridge.ZooKeeperClient`.

    Each acquisition writes a token of its own as the znode's data. A create whose reply was lost
    (``ConnectionLoss``) may have been applied: the next attempt then finds the znode, and knows it as its
    own by the token and the session. The original writes no data; it only ever looks at the znode's
    existence, so the token changes nothing for it.
    """

    def __init__(self, zk, path, reactor=None):
        if reactor is None:
            from twisted.internet import reactor
        self._zk = zk
        self._reactor = reactor
        self.path = path

    @defer.inlineCallbacks
    def acquire(self, timeout=None):
        """Fires once this session holds the lock; fails with :class:`LockTimeoutError` after
        ``timeout`` seconds (``None``: wait as long as it takes). The ZooKeeper calls it makes are bounded
        by the same time."""
        deadline = None if timeout is None else self._reactor.seconds() + timeout
        unanswered = "lock %s: ZooKeeper did not answer within %g s" % (self.path, timeout or 0)
        held = "lock %s is still held by another session after %g s" % (self.path, timeout or 0)
        token = os.urandom(16).hex().encode("ascii")
        while True:
            try:
                yield self._bounded(self._zk.create(self.path, token, ephemeral=True), deadline, unanswered)
                return
            except NodeExistsError:
                pass
            except ConnectionLoss:
                continue  # perhaps applied, its reply lost: the next attempt finds the znode with our token
            except LockTimeoutError:
                self._abandon(token)
                raise
            released = defer.Deferred()
            try:
                data, stat = yield self._bounded(
                    self._zk.get(self.path, watch=lambda _event: released.called or released.callback(None)),
                    deadline, unanswered)
            except (NoNodeError, ConnectionLoss):
                continue  # released meanwhile, or the reply was lost: try again at once
            if data == token and stat.ephemeralOwner == self._zk.session_id:
                return  # our own create, applied though its reply was lost
            yield self._bounded(released, deadline, held)

    def _bounded(self, d, deadline, message):
        """``d``, cancelled and failing with :class:`LockTimeoutError` (``message``) once ``deadline`` has
        passed."""
        if deadline is None:
            return d
        remaining = deadline - self._reactor.seconds()
        if remaining <= 0:
            d.cancel()
        else:
            d.addTimeout(remaining, self._reactor)

        def timed_out(reason):
            reason.trap(defer.TimeoutError, defer.CancelledError)
            raise LockTimeoutError(message)
        return d.addErrback(timed_out)

    def _abandon(self, token):
        """A create given up on may still be applied (ZooKeeper answers a session's requests in order, so a
        read sent now is answered after it): delete the znode if it turns out to be that create's. A read or
        delete that loses its connection, or gets no answer within the bridge's request timeout, is sent again as
        long as the session lasts: a znode left behind would hold the lock for nobody until the session ends."""
        session = self._zk.session_id

        def check(result):
            data, stat = result
            if data == token and stat.ephemeralOwner == session:
                return self._zk.delete(self.path, version=stat.version)

        def lost(reason):
            reason.trap(ConnectionLoss)
            if self._zk.session_id == session:
                self._abandon(token)

        d = self._zk.get(self.path).addCallback(check)
        d.addErrback(lost)
        d.addErrback(lambda _reason: None)  # gone already, session over: the znode is ephemeral, it went with it

    @defer.inlineCallbacks
    def release(self):
        """Delete the lock znode if this session holds it (already gone is fine). A lock znode of
        another session is left alone: after this session expired, someone else may hold the lock."""
        stat = yield self._zk.exists(self.path)
        if stat is None or stat.ephemeralOwner != self._zk.session_id:
            return
        yield self._zk.delete(self.path, version=stat.version).addErrback(swallow, NoNodeError)

    @defer.inlineCallbacks
    def run(self, function, *args, timeout=None, **kwargs):
        """Call ``function(*args, **kwargs)`` (may return a Deferred) while holding the lock,
        and release it however that ends; fires with the function's result."""
        yield self.acquire(timeout)
        try:
            result = yield defer.maybeDeferred(function, *args, **kwargs)
        finally:
            yield self.release()
        return result
