"""Reading committed records from whichever replica can serve them, checked, failing over.

Every joined replica of a store session holds the committed transactions, so a
read that one replica cannot serve (its storage is disconnected or stuck, a
record fails its checksum on its disk, or it has not stored the newest batch
yet) is asked of the next one. Only when every candidate failed does the read
fail, with each one's reason. One replica with a damaged disk thus slows the
partition's reads down by a round trip instead of stopping its feeds, its
transaction-data RPCs and the catch-up of other replicas.

An answer is used only when it is what was asked for (:func:`check_answer`):
at least one record, consecutive transaction ids from the first one asked,
no more than asked, and for full records a data checksum that matches. A short
answer is fine (the caller asks again for the rest); an empty one is not,
since the range asked for is committed.

Used by the store partition (feeds and transaction-data reads), by a store
session catching a joining replica up, and by recovery catching a lagging
replica up.
"""

from twisted.internet import defer

#: What a read asks for: the replica method and whether the answer carries data to check.
RECORDS = ("get_records", True)
HEADERS = ("get_headers", False)


class ReplicaReadError(Exception):
    """A replica's answer to a read is unusable (empty, out of order, too long or corrupted)."""


class NoReplicaCouldRead(Exception):
    """Every candidate replica failed a read; the message gives each one's reason."""


def check_answer(answer, first, count, with_data):
    """``answer`` as a tuple if it is a usable answer to a read of ``count`` records from ``first``.

    Raises :class:`ReplicaReadError` saying what is wrong otherwise.
    """
    answer = tuple(answer)
    if not answer:
        raise ReplicaReadError("no records from committed transaction %d on" % first)
    if len(answer) > count:
        raise ReplicaReadError("%d records for a read of %d" % (len(answer), count))
    for expected, item in enumerate(answer, first):
        if item.transaction_id != expected:
            raise ReplicaReadError("transaction %d where %d was expected" % (item.transaction_id, expected))
        if with_data and not item.is_valid():
            raise ReplicaReadError("transaction %d failed its data checksum" % expected)
    return answer


def read_from_any(candidates, what, first, count, on_failure=None) -> defer.Deferred:
    """Fires with a checked answer from the first of ``candidates`` (replica sessions) that gives one.

    ``what`` is :data:`RECORDS` or :data:`HEADERS`. ``on_failure(replica, failure)``, if given, is
    told of each replica that failed, before the next one is asked. Fails with
    :class:`NoReplicaCouldRead` when none could serve the read (or there were none).
    """
    return _ask(list(candidates), what, first, count, on_failure, [])


def _ask(candidates, what, first, count, on_failure, reasons):
    if not candidates:
        why = "; ".join(reasons) if reasons else "no replica to read from"
        return defer.fail(NoReplicaCouldRead("reading %d transaction(s) from %d: %s" % (count, first, why)))
    replica, rest = candidates[0], candidates[1:]
    method, with_data = what
    d = defer.maybeDeferred(getattr(replica, method), first, count)
    d.addCallback(check_answer, first, count, with_data)

    def failed(failure):
        if on_failure is not None:
            on_failure(replica, failure)
        reasons.append("storage %s: %s" % (replica.replica_id.storage, failure.getErrorMessage()))
        return _ask(rest, what, first, count, on_failure, reasons)

    return d.addErrback(failed)
