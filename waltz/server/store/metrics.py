"""Metrics of the store layer: recovery state transitions, batch sizes, replica reads that failed."""

from waltz.metrics import SIZE_BUCKETS
from waltz.recovery.manager import PartitionRecoveryState


class StoreMetrics:
    """Recovery transitions (per partition and state), batch sizes, replica reads that failed over."""

    _STATE_CODES = {state.value: code for code, state in enumerate(PartitionRecoveryState)}

    def __init__(self, registry):
        self.recovery_transitions = registry.counter(
            "waltz_server_recovery_transitions_total", "recovery state transitions of store sessions",
            ("partition", "state"))
        self.replica_transitions = registry.counter(
            "waltz_server_replica_recovery_transitions_total", "replica recovery state transitions",
            ("partition", "state"))
        self.recovery_state = registry.gauge(
            "waltz_server_recovery_state", "current recovery state of the partition's store session (%s)"
            % ", ".join("%d=%s" % (c, s) for s, c in self._STATE_CODES.items()), ("partition",))
        self.batch_size = registry.histogram(
            "waltz_server_store_batch_transactions", "transactions per replicated batch", ("partition",),
            SIZE_BUCKETS)
        self.read_failures = registry.counter(
            "waltz_server_replica_read_failures_total",
            "reads a replica failed (the next replica was asked): a damaged disk or a stuck storage",
            ("partition", "storage"))

    def recovery_transition(self, partition_id, state):
        self.recovery_transitions.inc(1, partition_id, state)
        self.recovery_state.set(self._STATE_CODES[state], partition_id)

    def partition_closed(self, partition_id):
        """The partition's store partition closed: forget its current recovery state."""
        self.recovery_state.remove(partition_id)

    def replica_transition(self, partition_id, state):
        self.replica_transitions.inc(1, partition_id, state)

    def read_failure(self, partition_id, storage):
        self.read_failures.inc(1, partition_id, storage)
