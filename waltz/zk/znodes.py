"""The cluster's znodes: their paths and the value classes stored in them.

Each value class is a frozen attrs class with ``encode()`` and
``decode(data, path)``; the byte layouts are the original's (see
``docs/zookeeper.md``). Map-like fields (storage connect string to partitions,
group or admin port) are kept as tuples of pairs sorted by key, so values are
hashable and compare equal whatever order the original wrote them in; the
constructors accept a ``dict`` too, and ``as_dict()`` gives one back.
"""

import uuid

import attr

from waltz.zk.encoding import DataReader, DataWriter, EncodingError
from waltz.zk.errors import ZnodeDecodeError

#: Java's ``"Cluster Manager".hashCode()``: the first four bytes of the cluster root.
CLUSTER_MAGIC = -1259834553
#: ``ReplicaState.UNRESOLVED`` (``Long.MIN_VALUE``): the closing high-water mark is not yet known.
UNRESOLVED = -(2 ** 63)


class _Codec:
    """Mixin: ``encode()`` / ``decode()`` around ``write_to(writer)`` / ``read_from(reader)``."""

    __slots__ = ()

    def encode(self):
        """The znode bytes for this value."""
        writer = DataWriter()
        self.write_to(writer)
        return writer.getvalue()

    @classmethod
    def decode(cls, data, path="<znode>"):
        """Decode znode bytes; raises :class:`ZnodeDecodeError` naming ``path``."""
        if not data:
            raise ZnodeDecodeError("znode %s is empty: expected %s data" % (path, cls.__name__))
        reader = DataReader(data)
        try:
            value = cls.read_from(reader)
            reader.finish()
        except EncodingError as exc:
            raise ZnodeDecodeError("znode %s does not hold valid %s data: %s" % (path, cls.__name__, exc)) from None
        return value


def _sorted_map(value_converter):
    """An attrs converter: a mapping or pairs -> a tuple of (key, value) pairs sorted by key."""
    def convert(mapping):
        items = mapping.items() if hasattr(mapping, "items") else mapping
        return tuple(sorted((key, value_converter(value)) for key, value in items))
    return convert


class _MapValue(_Codec):
    """Mixin for the ``connect string -> value`` store znodes (one field ``entries``)."""

    __slots__ = ()

    def as_dict(self):
        return dict(self.entries)

    def get(self, key, default=None):
        return self.as_dict().get(key, default)

    def __contains__(self, key):
        return any(k == key for k, _ in self.entries)

    def keys(self):
        return tuple(k for k, _ in self.entries)


# --- cluster manager znodes (zktools) -------------------------------------------------------------


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClusterParams(_Codec):
    """``<root>``: the cluster's name and partition count, behind the cluster-manager magic."""

    name: str
    num_partitions: int

    VERSION = 1

    def write_to(self, out):
        out.int(CLUSTER_MAGIC).byte(self.VERSION).utf(self.name).int(self.num_partitions)

    @classmethod
    def read_from(cls, inp):
        magic = inp.int("magic")
        if magic != CLUSTER_MAGIC:
            raise EncodingError("magic number mismatch: %d (expected %d)" % (magic, CLUSTER_MAGIC))
        inp.version(cls.VERSION)
        return cls(inp.utf("name"), inp.int("numPartitions"))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionInfo:
    """A partition assigned to a server, with its generation."""

    partition_id: int
    generation: int


def _partition_infos(values):
    return tuple(value if isinstance(value, PartitionInfo) else PartitionInfo(*value) for value in values)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionAssignment(_Codec):
    """``<root>/serverDescriptors``: which server holds which partitions (version 3).

    ``cversion`` is the children version of ``serverDescriptors`` this assignment
    was computed for; ``servers`` maps server id to its ``PartitionInfo`` tuple.
    """

    cversion: int = -1
    num_partitions: int = 0
    servers: tuple = attr.ib(default=(), converter=_sorted_map(_partition_infos))

    VERSION = 3

    def partitions_for(self, server_id):
        """The ``PartitionInfo`` tuple of ``server_id`` (empty if it has none)."""
        return dict(self.servers).get(server_id, ())

    def write_to(self, out):
        out.byte(self.VERSION).int(self.cversion).int(self.num_partitions).int(len(self.servers))
        for server_id, partitions in self.servers:
            out.int(server_id).int(len(partitions))
            for info in partitions:
                out.int(info.partition_id).int(info.generation)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION)
        cversion = inp.int("cversion")
        num_partitions = inp.int("numPartitions")
        servers, held = {}, set()
        for _ in range(inp.count("server", 8)):
            server_id = inp.int("serverId")
            if server_id in servers:
                raise EncodingError("server %d is listed twice" % server_id)
            infos = tuple(PartitionInfo(inp.int("partitionId"), inp.int("generation"))
                          for _ in range(inp.count("partition", 8)))
            for info in infos:
                # Two holders of one partition would both serve it at the same generation.
                if not 0 <= info.partition_id < num_partitions:
                    raise EncodingError("partition %d of server %d is not one of the %d partitions"
                                        % (info.partition_id, server_id, num_partitions))
                if info.partition_id in held:
                    raise EncodingError("partition %d is assigned twice" % info.partition_id)
                held.add(info.partition_id)
            servers[server_id] = infos
        return cls(cversion, num_partitions, servers)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ServerDescriptor(_Codec):
    """``<root>/serverDescriptors/s_<seq>``: one live server (ephemeral-sequential)."""

    server_id: int
    host: str
    port: int
    preferred_partitions: tuple = attr.ib(default=(), converter=tuple)

    VERSION = 1

    @property
    def endpoint(self):
        return "%s:%d" % (self.host, self.port)

    def write_to(self, out):
        out.byte(self.VERSION).int(self.server_id).utf(self.host).int(self.port).ints(self.preferred_partitions)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION)
        return cls(inp.int("serverId"), inp.utf("host"), inp.int("port"), inp.ints("preferred partition"))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class IdCounter(_Codec):
    """``<root>/ids/client`` and ``<root>/ids/server``: the last id handed out (a bare i32)."""

    value: int

    def write_to(self, out):
        out.int(self.value)

    @classmethod
    def read_from(cls, inp):
        return cls(inp.int("counter"))


# --- store znodes (Waltz) ---------------------------------------------------------------------------


@attr.s(frozen=True, slots=True, auto_attribs=True)
class StoreParams(_Codec):
    """``<root>/store``: the cluster key (random UUID set by ``create``) and partition count."""

    key: uuid.UUID
    num_partitions: int

    VERSION = 1

    def write_to(self, out):
        out.byte(self.VERSION).uuid(self.key).int(self.num_partitions)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION)
        return cls(inp.uuid("cluster key"), inp.int("numPartitions"))


@attr.s(frozen=True, slots=True, auto_attribs=True, order=True)
class ReplicaId(_Codec):
    """A replica: a partition on one storage node (``"host:port"``)."""

    partition_id: int
    storage: str

    VERSION = 1

    def write_to(self, out):
        out.byte(self.VERSION).int(self.partition_id).utf(self.storage)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION, "ReplicaId version")
        return cls(inp.int("partitionId"), inp.utf("storage connect string"))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReplicaState(_Codec):
    """A replica's last store session and that session's closing high-water mark."""

    replica_id: ReplicaId
    session_id: int
    closing_high_water_mark: int = UNRESOLVED

    VERSION = 1

    @property
    def is_resolved(self):
        return self.closing_high_water_mark != UNRESOLVED

    def write_to(self, out):
        out.byte(self.VERSION)
        self.replica_id.write_to(out)
        out.long(self.session_id).long(self.closing_high_water_mark)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION, "ReplicaState version")
        return cls(ReplicaId.read_from(inp), inp.long("sessionId"), inp.long("closingHighWaterMark"))


def _replica_states(states):
    """Replica states keyed by replica id (the last one wins, as in the original's map), sorted."""
    values = states.values() if hasattr(states, "values") else states
    by_id = {state.replica_id: state for state in values}
    return tuple(by_id[key] for key in sorted(by_id))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionMetadata(_Codec):
    """``<root>/store/partition/<id>``: generation, current store session id and replica states."""

    generation: int
    session_id: int
    replica_states: tuple = attr.ib(default=(), converter=_replica_states)

    VERSION = 1

    def replica_state(self, replica_id):
        """The state of ``replica_id``, or ``None``."""
        return next((s for s in self.replica_states if s.replica_id == replica_id), None)

    def write_to(self, out):
        out.byte(self.VERSION).int(self.generation).long(self.session_id).int(len(self.replica_states))
        for state in self.replica_states:
            state.write_to(out)

    @classmethod
    def read_from(cls, inp):
        inp.version(cls.VERSION)
        generation = inp.int("generation")
        session_id = inp.long("sessionId")
        count = inp.count("replica state", 1 + 1 + 4 + 2 + 8 + 8)
        return cls(generation, session_id, [ReplicaState.read_from(inp) for _ in range(count)])


#: The partition metadata before the first store session (``PartitionMetadata.EMPTY``).
EMPTY_PARTITION_METADATA = PartitionMetadata(-1, -1, ())


def _storage_map_codec(name, read_value, write_value, value_converter, min_value_size):
    """write_to / read_from for a ``v1, n x (connect string, value)`` store znode."""
    def write_to(self, out):
        out.byte(1).int(len(self.entries))
        for storage, value in self.entries:
            out.utf(storage)
            write_value(out, value)

    @classmethod
    def read_from(cls, inp):
        inp.version(1)
        entries = {}
        for _ in range(inp.count(name, 2 + min_value_size)):
            storage = inp.utf("storage connect string")
            entries[storage] = read_value(inp)
        return cls(entries)

    return write_to, read_from, _sorted_map(value_converter)


_ASSIGNMENT = _storage_map_codec("replica assignment", lambda inp: inp.ints("partitionId"),
                                 lambda out, ids: out.ints(ids), tuple, 4)
_INT_MAP = _storage_map_codec("storage entry", lambda inp: inp.int("value"),
                              lambda out, value: out.int(value), int, 4)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReplicaAssignments(_MapValue):
    """``<root>/store/assignment``: storage connect string -> the partition ids it replicates."""

    entries: tuple = attr.ib(default=(), converter=_ASSIGNMENT[2])
    write_to, read_from = _ASSIGNMENT[:2]

    def replicas_of(self, partition_id):
        """The storages holding ``partition_id``, sorted."""
        return tuple(storage for storage, ids in self.entries if partition_id in ids)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class GroupDescriptor(_MapValue):
    """``<root>/store/group``: storage connect string -> group id."""

    entries: tuple = attr.ib(default=(), converter=_INT_MAP[2])
    write_to, read_from = _INT_MAP[:2]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ConnectionMetadata(_MapValue):
    """``<root>/store/connection``: storage connect string -> admin port."""

    entries: tuple = attr.ib(default=(), converter=_INT_MAP[2])
    write_to, read_from = _INT_MAP[:2]


# --- paths --------------------------------------------------------------------------------------------


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClusterPaths:
    """Every znode path of the cluster rooted at ``root`` (e.g. ``/waltz_cluster``)."""

    root: str = attr.ib()

    @root.validator
    def _check_root(self, _attribute, value):
        if not value.startswith("/") or value.endswith("/") or "//" in value:
            raise ValueError("cluster root must be an absolute znode path like /waltz_cluster, got %r" % value)

    def _join(self, *names):
        return "/".join((self.root,) + names)

    @property
    def server_descriptors(self):
        return self._join("serverDescriptors")

    @property
    def server_descriptor_prefix(self):
        """The prefix ZooKeeper appends a sequence number to for each live server."""
        return self._join("serverDescriptors", "s_")

    @property
    def ids(self):
        return self._join("ids")

    @property
    def client_ids(self):
        return self._join("ids", "client")

    @property
    def server_ids(self):
        return self._join("ids", "server")

    @property
    def store(self):
        return self._join("store")

    @property
    def partitions(self):
        return self._join("store", "partition")

    def partition(self, partition_id):
        return self._join("store", "partition", str(int(partition_id)))

    @property
    def assignment(self):
        return self._join("store", "assignment")

    @property
    def group(self):
        return self._join("store", "group")

    @property
    def connection(self):
        return self._join("store", "connection")

    @property
    def admin_lock(self):
        return self._join("store", "adminLock")
