"""zope.interface contracts shared between packages.

The card's rule: the server's partition sees the replicated store only through
:class:`IStorePartition`; a store session (and the recovery it runs) sees each
storage replica only through :class:`IReplicaSession`; recovery reads and
writes the partition's metadata only through :class:`IPartitionMetadataStore`.
"""

from zope.interface import Attribute, Interface


class IStorePartition(Interface):
    """A partition replicated to a quorum of storage nodes, as the server's partition uses it."""

    partition_id = Attribute("The partition id.")
    high_water_mark = Attribute("The id of the last committed transaction (-1 when none).")
    healthy = Attribute("True while a store session is open and writing.")
    lost = Attribute("Why the partition was lost (another server's newer generation), or None.")

    def append(req_id, header, data, checksum):
        """Queue one transaction; fires with its transaction id once a quorum stored it durably.

        Fails with ``AppendFailed`` when it is known not to be committed (the
        caller may retry it). An append whose fate was unknown when its session
        died is settled by the next session's recovery, never reported twice.
        """

    def flush():
        """Fires with the high-water mark once every append queued before it is settled."""

    def get_record(transaction_id):
        """Fires with the committed ``Record``, or ``None`` above the high-water mark."""

    def get_records(transaction_id, max_records):
        """Fires with up to ``max_records`` committed records from ``transaction_id`` on (consecutive,
        their checksums verified; from whichever replica serves them)."""

    def get_headers(transaction_id, max_records):
        """Fires with up to ``max_records`` committed ``RecordHeader``s from ``transaction_id`` on
        (consecutive; from whichever replica serves them)."""

    def add_listener(listener):
        """``listener(high_water_mark)`` is called after each commit and each recovery."""

    def add_lost_listener(listener):
        """``listener(reason)`` is called once if the partition is lost: another server opened a store session
        at a newer generation (``lost`` then says why)."""

    def close():
        """Stop writing; pending appends fail. Fires when closed."""


class IReplicaSession(Interface):
    """One storage replica of a partition within one store session (requests carry the session id)."""

    replica_id = Attribute("The ``ReplicaId`` (partition id, storage connect string).")
    session_id = Attribute("The store session id sent with every request.")
    connected = Attribute("True while the connection to the storage node is open.")

    def when_connected():
        """Fires once the replica's storage node is connected (at once if it is)."""

    def on_disconnect(callback):
        """``callback(replica_session)`` is called once when the connection is lost."""

    def last_session_info():
        """Fires with ``(last_session_id, low_water_mark, local_low_water_mark)`` of the storage."""

    def max_transaction_id():
        """Fires with the highest transaction id the storage holds."""

    def truncate(transaction_id):
        """Drop everything after ``transaction_id``; fires with the new max transaction id."""

    def set_low_water_mark(low_water_mark):
        """Record this session's low-water mark on the storage (durably)."""

    def append(records):
        """Append records (continuing the storage's sequence); fires once they are durable."""

    def get_records(transaction_id, max_records):
        """Fires with up to ``max_records`` records from ``transaction_id`` on."""

    def get_headers(transaction_id, max_records):
        """Fires with up to ``max_records`` record headers from ``transaction_id`` on."""


class IPartitionMetadataStore(Interface):
    """The partition metadata (generation, session id, replica states) as recovery sees it."""

    def read(partition_id):
        """Fires with the current ``PartitionMetadata``."""

    def update(partition_id, change):
        """Compare-and-set: fires with ``change(current)`` once stored.

        ``change`` may raise to abort (for example when another session took
        over); the failure is the Deferred's.
        """
