"""The optimistic lock table of one partition (seed 001 "Concurrency Control", reference section 5).

The table is a fixed array of high-water marks. Each lock hash (computed by
the client with :func:`waltz.protocols.locks.lock_hash`) maps to
:data:`NUM_HASH_FUNCTIONS` slots through a 32-bit linear congruential
generator (:func:`lock_slots`). All slots start at the partition's
high-water mark when the append task starts.

* The **estimate** of one lock is the minimum over its slots: it is never
  lower than the id of the last committed transaction that wrote (or
  appended) that lock, because every such commit raised all of its slots.
* The estimate of a request is the maximum over its **write and read**
  locks (``-1`` when it has none). When it is strictly greater than the
  client's high-water mark the request fails (``LOCK_FAILURE``), otherwise
  the client had seen every transaction that touched its locks.
* On commit the slots of **write and append** locks are raised to the
  transaction id; read locks are never updated; append locks are never
  checked (reference PR #77).

Requests whose checked locks are write or append locks of a request that is
on its way to the store (*in flight*: sent, not yet committed or failed) cannot
be decided yet: :meth:`LockTable.check` answers :attr:`LockOutcome.IN_FLIGHT`
and the append task re-checks once in-flight requests settle. Only the same
lock hash counts: locks that merely share slots do not conflict, and waiting on
them would stall the append queue for nothing. Together these
rules never let a conflicting transaction through (no false negatives); hash
collisions only cause spurious failures (false positives).
"""

import collections
import enum

import attr

#: Slots per lock hash (the original hard-codes 3).
NUM_HASH_FUNCTIONS = 3

#: The 32-bit LCG that derives the slots: ``h = h * MULTIPLIER + INCREMENT (mod 2**32)``.
LCG_MULTIPLIER = 1103515245
LCG_INCREMENT = 12345
#: A slot is ``(h & SLOT_MASK) % table_size`` (the mask makes the value non-negative).
SLOT_MASK = 0x3FFFFFFF

_MASK32 = 0xFFFFFFFF


def lock_slots(lock_hash: int, table_size: int) -> tuple:
    """The :data:`NUM_HASH_FUNCTIONS` table slots of ``lock_hash`` (with repeats when they collide).

    Unrolled for the three hash functions: this runs for every lock of every append.
    """
    h1 = ((lock_hash & _MASK32) * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
    h2 = (h1 * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
    h3 = (h2 * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
    return (h1 & SLOT_MASK) % table_size, (h2 & SLOT_MASK) % table_size, (h3 & SLOT_MASK) % table_size


def checked_hashes(request) -> tuple:
    """Hashes whose estimate decides ``request`` (a :class:`LockRequest` or an ``AppendRequest``): write then
    read locks."""
    return request.write_locks + request.read_locks


def updated_hashes(request) -> tuple:
    """Hashes whose slots a commit of ``request`` raises: write then append locks."""
    return request.write_locks + request.append_locks


@attr.s(frozen=True, slots=True)
class LockRequest:
    """The lock hashes of one append: ``write_locks`` and ``read_locks`` are checked,
    ``write_locks`` and ``append_locks`` are updated on commit."""

    write_locks = attr.ib(default=(), converter=tuple)
    read_locks = attr.ib(default=(), converter=tuple)
    append_locks = attr.ib(default=(), converter=tuple)

    @classmethod
    def of(cls, append_request) -> "LockRequest":
        """The locks carried by an ``AppendRequest``."""
        return cls(append_request.write_locks, append_request.read_locks, append_request.append_locks)

    @property
    def checked(self) -> tuple:
        """Hashes whose estimate decides the request: write then read locks."""
        return checked_hashes(self)

    @property
    def updated(self) -> tuple:
        """Hashes whose slots a commit raises: write then append locks."""
        return updated_hashes(self)

    @property
    def empty(self) -> bool:
        return not (self.write_locks or self.read_locks or self.append_locks)


NO_LOCKS = LockRequest()


class LockOutcome(enum.Enum):
    """What :meth:`LockTable.check` decided."""

    GRANTED = "granted"      #: the client saw every transaction that touched its checked locks
    FAILED = "failed"        #: the estimate is above the client's high-water mark: LOCK_FAILURE
    IN_FLIGHT = "in-flight"  #: a checked lock is being updated by an in-flight request: wait, then re-check


class LockCheck(collections.namedtuple("LockCheck", "outcome estimate")):
    """The outcome of a check and the request's estimated lock high-water mark.

    (A named tuple rather than an attrs class: one is made per append, and a tuple is made faster.)
    """

    __slots__ = ()


class HeldLocks(collections.namedtuple("HeldLocks", "hashes slots")):
    """The locks an in-flight request will raise on commit (a tuple of hashes), and their slots (a tuple),
    from :meth:`LockTable.begin`."""

    __slots__ = ()


class LockTable:
    """The lock table of one partition: ``size`` i64 slots starting at ``high_water_mark``."""

    def __init__(self, size: int = 30000, high_water_mark: int = -1):
        if size <= 0:
            raise ValueError("the lock table size must be positive, not %d" % size)
        self.size = size
        self._marks = [high_water_mark] * size
        # Every slot's mark is at least this (reset() raises it instead of rewriting a list of up to 2**22 slots,
        # which took most of a second on the reactor thread).
        self._floor = high_water_mark
        # Lock hashes that in-flight requests will raise on commit. Only the same lock can conflict: two locks
        # that merely share slots do not, so tracking hashes (not slots) avoids false waits.
        self._in_flight = {}   # lock hash -> in-flight requests updating it
        self.held = 0

    def slots(self, lock_hash: int) -> tuple:
        """The slots of one lock hash in this table."""
        return lock_slots(lock_hash, self.size)

    def lock_estimate(self, lock_hash: int) -> int:
        """The estimated high-water mark of one lock: the minimum over its slots."""
        return self._estimate((lock_hash,))

    def estimate(self, request: LockRequest) -> int:
        """The estimate of a request: the maximum over its write and read locks, ``-1`` without any."""
        return self._estimate(checked_hashes(request))

    def _estimate(self, hashes) -> int:
        """The maximum over ``hashes`` of each one's minimum slot mark (-1 without any).

        :func:`lock_slots` inlined, with plain comparisons: this runs for every append (a call per lock
        cost 0.5 µs more). ``tests/server/test_locks.py`` checks that both give the same slots.
        """
        marks, size = self._marks, self.size
        estimate = -1
        for h in hashes:
            h1 = ((h & _MASK32) * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
            h2 = (h1 * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
            h3 = (h2 * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK32
            mark = marks[(h1 & SLOT_MASK) % size]
            other = marks[(h2 & SLOT_MASK) % size]
            if other < mark:
                mark = other
            other = marks[(h3 & SLOT_MASK) % size]
            if other < mark:
                mark = other
            if mark > estimate:
                estimate = mark
        if hashes and estimate < self._floor:
            estimate = self._floor
        return estimate

    def in_flight_conflict(self, request: LockRequest) -> bool:
        """True when a checked lock is one an in-flight request will update."""
        return self._in_flight_among(checked_hashes(request))

    def _in_flight_among(self, hashes) -> bool:
        in_flight = self._in_flight
        if in_flight:
            for h in hashes:
                if h in in_flight:
                    return True
        return False

    def check(self, request: LockRequest, client_high_water_mark: int) -> LockCheck:
        """Decide ``request`` for a client that has seen transactions up to ``client_high_water_mark``.

        ``request`` is anything with the three tuples ``write_locks``, ``read_locks`` and
        ``append_locks``: a :class:`LockRequest`, or the ``AppendRequest`` itself.
        """
        checked = checked_hashes(request)
        estimate = self._estimate(checked)
        if self._in_flight_among(checked):
            return LockCheck(LockOutcome.IN_FLIGHT, estimate)
        return LockCheck(LockOutcome.FAILED if estimate > client_high_water_mark else LockOutcome.GRANTED,
                         estimate)

    def begin(self, request: LockRequest) -> HeldLocks:
        """Mark the locks ``request`` will update as in flight; settle with :meth:`commit` or :meth:`release`."""
        hashes = updated_hashes(request)
        in_flight, size = self._in_flight, self.size
        slots = []
        for h in hashes:
            in_flight[h] = in_flight.get(h, 0) + 1
            slots += lock_slots(h, size)
        self.held += 1
        return HeldLocks(hashes, tuple(slots))

    def commit(self, held: HeldLocks, transaction_id: int):
        """The request committed as ``transaction_id``: raise its slots, then release them."""
        marks = self._marks
        for slot in held.slots:
            if marks[slot] < transaction_id:
                marks[slot] = transaction_id
        self.release(held)

    def release(self, held: HeldLocks):
        """The request settled without committing (or after :meth:`commit`): no longer in flight."""
        in_flight = self._in_flight
        for h in held.hashes:
            count = in_flight[h] - 1
            if count:
                in_flight[h] = count
            else:
                del in_flight[h]
        self.held -= 1

    def reset(self, high_water_mark: int):
        """Raise every slot to at least ``high_water_mark`` (after commits the table did not see)."""
        if high_water_mark > self._floor:
            self._floor = high_water_mark
