"""Quorum voting on the closing high-water mark of a store session (seed 000).

Each replica of the electorate (the replicas that took part in the last
session that could write; see :mod:`waltz.recovery.manager`) votes with its
high-water mark X, which counts as a vote for every high-water mark H <= X.
The resolved closing high-water mark is the highest H that a quorum (a
majority of the electorate) votes for: everything at or below it was on a
quorum, so it may have been acknowledged; everything above it was never on a
quorum, so it was not.

A replica that has not voted (unreachable, still being read) might hold more.
Examining candidates from the highest down, a candidate whose votes plus the
replicas that have not voted could still reach the quorum makes the outcome
*undecidable*: a missing vote could prove a higher mark committed. Recovery
then waits and votes again whenever anything changes.
"""

import attr


def quorum_of(num_replicas: int) -> int:
    """The size of a majority of ``num_replicas`` assigned replicas."""
    if num_replicas < 1:
        raise ValueError("a partition needs at least one replica, got %d" % num_replicas)
    return num_replicas // 2 + 1


@attr.s(frozen=True, slots=True, auto_attribs=True)
class VoteOutcome:
    """The result of one round of voting.

    ``high_water_mark`` is the resolved closing high-water mark, or ``None``
    when the round is undecidable; ``reason`` says why, for logs and metrics.
    """

    high_water_mark: object
    reason: str

    @property
    def decided(self) -> bool:
        return self.high_water_mark is not None


def resolve_high_water_mark(votes, num_replicas: int) -> VoteOutcome:
    """Decide the closing high-water mark from ``votes`` of ``num_replicas`` assigned replicas.

    ``votes`` are the high-water marks of the replicas that voted (one per
    replica); the others count as offline. -1 is the mark of an empty log.
    """
    votes = list(votes)
    if len(votes) > num_replicas:
        raise ValueError("%d votes from %d replicas" % (len(votes), num_replicas))
    quorum = quorum_of(num_replicas)
    offline = num_replicas - len(votes)
    for candidate in sorted(set(votes), reverse=True):
        supporters = sum(1 for vote in votes if vote >= candidate)
        if supporters >= quorum:
            return VoteOutcome(candidate, "%d of %d replicas hold %d (quorum %d)"
                               % (supporters, num_replicas, candidate, quorum))
        if supporters + offline >= quorum:
            return VoteOutcome(None, "undecidable: %d vote(s) for %d and %d replica(s) not voting could reach "
                                     "the quorum of %d" % (supporters, candidate, offline, quorum))
    return VoteOutcome(None, "undecidable: %d of %d replicas voted, quorum %d" % (len(votes), num_replicas, quorum))
