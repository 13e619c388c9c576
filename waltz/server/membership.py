"""Cluster membership of a Waltz server: its id, its descriptor znode, and the partition assignment.

A :class:`ServerMembership` (the original's ``ClusterManagerImpl`` on the
server side):

* allocates the server id once (the ``<root>/ids/server`` counter);
* registers the server's ephemeral-sequential descriptor under
  ``<root>/serverDescriptors`` (id, advertised host and port, preferred
  partitions);
* watches both the children and the data of ``serverDescriptors`` and, at
  every change, *reconciles*: it reads the stored assignment with its stat,
  then the live descriptors. When the stored assignment's cversion equals the
  znode's children version the assignment is current, and this server's
  ``{partition: generation}`` is reported to ``on_assignment`` (only when it
  changed). Otherwise the live server with the lowest id, the coordinator,
  computes a new assignment (:func:`waltz.server.assignment.compute_assignment`)
  and writes it with a version check; a conflicting write makes it start over.
  The write changes the znode's data, so every server reconciles again and
  adopts it;
* after the ZooKeeper session *expired* (its descriptor is gone) it registers
  again, with the same server id, as soon as a new session is connected;
* at every pass it checks its own registration: exactly one descriptor of this
  server in the current session, with the current content. A create whose reply
  was lost (the znode was made, the client did not hear of it) or a preferred-
  partitions change of unknown outcome is repaired there, in one multi-op.

**The session and the partitions.** The partitions this server holds are only
its own while its descriptor is registered: once the session is gone the
coordinator hands them to the other servers at new generations. So

* when the session *expires* the server gives up every partition at once
  (``on_assignment({})``), before it registers again;
* when the connection is lost it may be the session's end: ZooKeeper expires a
  session T (the session timeout) after it last heard from it, and kazoo notices
  a silent loss (no reset: packets dropped) only when a heartbeat goes
  unanswered, up to 2/3 T after the last reply. So the server counts from its
  *last confirmed contact*: it probes ZooKeeper every T/6 (a ``sync`` of the
  root, which goes through the leader: the one that expires sessions) and
  remembers when the last answered probe was sent (the leader heard from the
  session about then at the latest). Disconnected, or connected with no probe
  answered (a follower cut off from the leader still answers pings), it gives its
  partitions up 0.8 T after that (``give_up_after``; the connected case at the
  next probe, so up to T/6 later): before ZooKeeper can expire the session and
  the coordinator move them, without waiting to hear of the expiry (the
  reconnect may hang for a long time). A blip shorter than that (a ZooKeeper
  restart) changes nothing; a connection back later gets the partitions again
  from the assignment (the same generations, if the session survived);
* after every reconnect it reconciles again: kazoo does not re-register watches
  on a new connection (no ``SetWatches``), and changes made while it was away are
  otherwise seen only if its watch recipes notice them. A pass that fails is
  retried until one succeeds; a pass acts only if the server is still a member in
  the session it read in;
* if kazoo gives up for good (``LOST`` without a stop of ours: its connection
  thread died, or authentication failed) the server gives its partitions up at
  once and serves nothing until it is restarted (``/health`` reports ZooKeeper
  lost).

States (:class:`MembershipState`), changed only through ``_enter``:
``NEW -> JOINING -> MEMBER``, ``MEMBER -> REJOINING -> MEMBER`` after an
expiry, and ``STOPPED`` from any state. Everything runs on the reactor thread.
"""

import enum
import random as random_module

from kazoo.exceptions import BadVersionError, NoNodeError
from twisted.internet import defer, task
from twisted.logger import Logger

from waltz.server.assignment import compute_assignment, partitions_of
from waltz.zk.bridge import SessionState
from waltz.zk.errors import swallow
from waltz.zk.znodes import ServerDescriptor


#: A disconnected server gives its partitions up this fraction of the session timeout after its last
#: confirmed contact with ZooKeeper (which expires the session one timeout after it last heard from it).
GIVE_UP_FRACTION = 0.8
#: Liveness probes per session timeout.
PROBES_PER_SESSION_TIMEOUT = 6


def _session_timeout_ms(zk, log):
    """The session timeout T the give-up counts with: the one asked for, or the one ZooKeeper negotiated when
    shorter (it bounds what a client asks by its ``maxSessionTimeout``: counting with the longer one would
    give the partitions up after ZooKeeper could have moved them)."""
    requested = getattr(zk, "session_timeout_ms", 30000)
    negotiated = getattr(zk, "negotiated_session_timeout_ms", None)
    if negotiated is None or negotiated == requested:
        return requested
    log.warn("ZooKeeper granted a session timeout of {negotiated} ms where zookeeper.sessionTimeout asks for "
             "{requested} ms (it bounds it by its minSessionTimeout and maxSessionTimeout); the partitions are "
             "given up by the shorter one", negotiated=negotiated, requested=requested)
    return min(requested, negotiated)


class MembershipState(enum.Enum):
    NEW = "new"
    JOINING = "joining"        # allocating the server id, registering the descriptor
    MEMBER = "member"          # registered; watching membership and assignment
    REJOINING = "rejoining"    # the session expired: waiting for a new one to register again
    STOPPED = "stopped"


class InvalidPartitions(ValueError):
    """Preferred partition ids outside ``0 .. numPartitions - 1``."""


def check_partitions(partition_ids, num_partitions):
    """Raise :class:`InvalidPartitions` naming the ids of ``partition_ids`` outside the cluster's partitions."""
    bad = sorted(set(p for p in partition_ids if not 0 <= p < num_partitions))
    if bad:
        # A request may carry millions of ids: the message (logged) names a few and counts the rest.
        shown = ", ".join(str(p) for p in bad[:_BAD_IDS_SHOWN])
        more = " and %d more" % (len(bad) - _BAD_IDS_SHOWN) if len(bad) > _BAD_IDS_SHOWN else ""
        raise InvalidPartitions("partition ids [%s]%s are not in 0..%d" % (shown, more, num_partitions - 1))


_BAD_IDS_SHOWN = 10


class ServerMembership:
    """One server's membership in the cluster of ``cluster`` (a :class:`ClusterMetadata`).

    ``on_assignment(partitions)`` is called on the reactor thread with this
    server's ``{partition id: generation}`` each time its part of a current
    assignment changes, and with ``{}`` when the server must give up its
    partitions because its session expired (or may have: see the module doc).
    ``rng`` shuffles the assignment lists (tests inject one); ``retry_interval``
    (seconds) spaces retries after ZooKeeper errors; a reconcile pass that keeps failing (ZooKeeper
    errors, a partition that cannot be opened) is retried after doubling delays up to
    ``max_retry_interval``, from ``retry_interval`` again once a pass succeeds; ``give_up_after`` (seconds,
    default: 0.8 of the ZooKeeper client's session timeout, see the module doc) is
    how long after its last confirmed contact with ZooKeeper a disconnected server
    gives up its partitions.
    """

    log = Logger()

    def __init__(self, cluster, host, port, on_assignment, preferred_partitions=(), reactor=None, rng=None,
                 retry_interval=0.5, max_retry_interval=8.0, give_up_after=None, on_give_up=None):
        if reactor is None:
            from twisted.internet import reactor
        self.cluster = cluster
        self.host = host
        self.port = port
        self.preferred_partitions = tuple(sorted(set(preferred_partitions)))
        self.on_assignment = on_assignment
        #: ``on_give_up(why)``, called after ``on_assignment({})`` when the server gives its partitions up
        #: for want of ZooKeeper (the assignment it had may still be current: it may get them back as they were).
        self.on_give_up = on_give_up
        self.reactor = reactor
        self.rng = rng or random_module.Random()
        self.retry_interval = retry_interval
        self.max_retry_interval = max(retry_interval, max_retry_interval)
        self._reconcile_failures = 0    # reconcile passes failed in a row: the next retry's delay doubles
        session_timeout = _session_timeout_ms(cluster.zk, self.log) / 1000.0
        self.give_up_after = GIVE_UP_FRACTION * session_timeout if give_up_after is None else give_up_after
        self.probe_interval = session_timeout / PROBES_PER_SESSION_TIMEOUT
        self._last_contact = None       # reactor time at which the last answered probe was sent
        self._probing = False
        #: Why the partitions were given up although connected (unanswered probes, see _check_contact),
        #: until a probe is answered again; None otherwise. ``/health`` reports it.
        self.given_up_while_connected = None
        self._prober = task.LoopingCall(self._probe)
        self._prober.clock = reactor
        self.state = MembershipState.NEW
        self.server_id = None
        self.num_partitions = None
        self.znode = None              # path of our descriptor while registered
        self.assignment = None         # the last current PartitionAssignment seen
        self.partitions = {}           # our part of it: partition id -> generation
        #: True while what the server holds is not known to be ``partitions``: an ``on_assignment`` call
        #: is running, or raised (it may have opened or closed some of them). A give-up then still runs.
        self._holding_unknown = False
        self.members = {}              # live server id -> ServerDescriptor, at the last reconcile
        self.reconciles = 0            # completed reconcile passes
        self.assignments_written = 0   # assignments this server wrote as the coordinator
        self._watches = []
        self._listening = False
        self._rejoining = False
        self._reconciling = False
        self._reconcile_again = False
        # Separate timers: a rejoin retry pending must not stand in for a reconcile retry (or back).
        self._rejoin_call = None
        self._reconcile_call = None
        self._disconnected_call = None  # gives the partitions up if the connection stays lost
        # Registration changes (re-registering, preferred partitions) one at a time; the count tells a
        # reconcile pass whether one happened while it read the descriptors.
        self._registration_lock = defer.DeferredLock()
        self._registrations = 0

    # --- state ---------------------------------------------------------------------------------

    def _enter(self, state):
        if state is not self.state:
            self.log.info("server {id} membership: {old} -> {new}", id=self.server_id, old=self.state.value,
                          new=state.value)
            self.state = state

    @property
    def descriptor(self):
        """This server's :class:`ServerDescriptor` (``None`` before it has an id)."""
        if self.server_id is None:
            return None
        return ServerDescriptor(self.server_id, self.host, self.port, self.preferred_partitions)

    @property
    def is_coordinator(self):
        """Whether this server has the lowest id among the live servers (at the last reconcile)."""
        return bool(self.members) and min(self.members) == self.server_id

    # --- start and stop -------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.state is MembershipState.STOPPED

    @defer.inlineCallbacks
    def start(self):
        """Allocate the id, register, and watch; fires once the watches are set (or at once, doing
        nothing more, when :meth:`stop` was called meanwhile)."""
        self._enter(MembershipState.JOINING)
        params = yield self.cluster.cluster_params()
        self.num_partitions = params.num_partitions
        self._check_partitions(self.preferred_partitions)
        self.server_id = yield self.cluster.allocate_server_id()
        if self.stopped:
            return self
        self.cluster.zk.add_state_listener(self._session_changed)
        self._listening = True
        sent = self.reactor.seconds()
        yield self._register()
        if self.stopped:
            return self
        self._contact(sent)
        self._prober.start(self.probe_interval, now=False).addErrback(self._prober_failed)
        self._enter(MembershipState.MEMBER)
        path = self.cluster.paths.server_descriptors
        for watch in (self.cluster.zk.watch_children(path, self._membership_changed),
                      self.cluster.zk.watch_data(path, self._assignment_changed)):
            handle = yield watch
            if self.stopped:
                handle.cancel()
            else:
                self._watches.append(handle)
        return self

    @defer.inlineCallbacks
    def _register(self):
        znode = yield self.cluster.register_server(self.descriptor)
        if self.stopped:   # stop() ran meanwhile and could not delete it: do it now
            yield self._delete_descriptor(znode)
            return
        self.znode = znode
        self._registrations += 1
        self.log.info("server {id} registered as {znode} ({host}:{port}, preferred partitions {preferred})",
                      id=self.server_id, znode=self.znode, host=self.host, port=self.port,
                      preferred=list(self.preferred_partitions))

    @defer.inlineCallbacks
    def stop(self):
        """Stop watching and remove the descriptor (when the session still allows)."""
        if self.state is MembershipState.STOPPED:
            return
        self._enter(MembershipState.STOPPED)
        for handle in self._watches:
            handle.cancel()
        self._watches = []
        for call in (self._rejoin_call, self._reconcile_call):
            if call is not None and call.active():
                call.cancel()
        self._cancel_disconnected_call()
        if self._prober.running:
            self._prober.stop()
        if self._listening:
            self._listening = False
            self.cluster.zk.remove_state_listener(self._session_changed)
        znode, self.znode = self.znode, None
        yield self._delete_descriptor(znode)

    @defer.inlineCallbacks
    def _delete_descriptor(self, znode):
        if znode is not None and self.cluster.zk.connected:
            try:
                yield self.cluster.zk.delete(znode).addErrback(swallow, NoNodeError)
            except Exception as exc:
                self.log.warn("could not delete {znode}: {error}", znode=znode, error=exc)

    # --- session -------------------------------------------------------------------------------

    def _session_changed(self, state):
        if self.state not in (MembershipState.MEMBER, MembershipState.REJOINING):
            return
        if state == SessionState.SUSPENDED:
            if self._disconnected_call is None:
                now = self.reactor.seconds()
                last = self._last_contact if self._last_contact is not None else now
                self._disconnected_call = self.reactor.callLater(max(0.0, last + self.give_up_after - now),
                                                                 self._disconnected_too_long)
            return
        self._cancel_disconnected_call()
        if state == SessionState.CONNECTED:
            self._contact(self.reactor.seconds())
        if state == SessionState.LOST:
            # Not our own stop (it stops listening first): kazoo gave up for good (its connection thread
            # died, or authentication failed). Nothing will say when the session expires: stop now.
            self.log.error("server {id}: the ZooKeeper client stopped for good; this server serves no "
                           "partition until it is restarted", id=self.server_id)
            self._give_up_partitions("the ZooKeeper client stopped")
        elif state == SessionState.EXPIRED:
            self.znode = None
            self._enter(MembershipState.REJOINING)
            self._give_up_partitions("the ZooKeeper session expired")
        elif state == SessionState.CONNECTED:
            if self.state is MembershipState.REJOINING:
                self._rejoin()
            else:
                # Same session, new connection: whatever changed meanwhile, read it again.
                self.request_reconcile()

    def _cancel_disconnected_call(self):
        call, self._disconnected_call = self._disconnected_call, None
        if call is not None and call.active():
            call.cancel()

    def _disconnected_too_long(self):
        self._disconnected_call = None
        if self.cluster.zk.connected:
            return
        self._give_up_partitions("no contact with ZooKeeper for %.1f s: the session may have expired and the "
                                 "partitions moved" % (self.reactor.seconds() - self._last_contact))

    def _probe(self):
        """Sync with the ZooKeeper leader; an answer proves the leader, which expires sessions, heard from
        this session around the time it was sent. (A read would not: a follower cut off from the leader
        answers reads, and pings, until it notices, up to ``syncLimit`` ticks later, while the leader lets
        the session expire.)"""
        self._check_contact()
        if self._probing or not self.cluster.zk.connected:
            return
        self._probing = True
        sent = self.reactor.seconds()
        d = self.cluster.zk.sync(self.cluster.paths.root)
        d.addCallbacks(lambda _: self._contact(sent), lambda _: None)   # no answer: no contact, nothing else
        d.addBoth(self._probed)

    def _probed(self, _):
        self._probing = False

    def _check_contact(self):
        """Give the partitions up when the last confirmed contact is ``give_up_after`` old although the
        connection is up: a follower cut off from the leader keeps answering pings (kazoo stays connected)
        while the leader, which expires sessions, hears nothing. (Disconnected, the timer armed on
        SUSPENDED does it; a give-up of that timer that raised is tried again here.) Checked at each
        probe, so up to T/6 late: still before T, and before adopting an assignment: a server holding
        nothing when its contact went stale must not take partitions on through that follower either."""
        if not self._contact_stale():
            return
        silent = self.reactor.seconds() - self._last_contact
        if not self.cluster.zk.connected:
            if (self.partitions or self._holding_unknown) and self._disconnected_call is None:
                self._disconnected_too_long()
        else:
            self.given_up_while_connected = ("partitions given up (none taken on): no ZooKeeper probe answered "
                                             "for %.1f s although connected (the leader may not hear from this "
                                             "session)" % silent)
            self._give_up_partitions(self.given_up_while_connected)

    def _contact_stale(self) -> bool:
        """True once the last confirmed contact with ZooKeeper is ``give_up_after`` old."""
        return self._last_contact is not None and self.reactor.seconds() - self._last_contact >= self.give_up_after

    def _contact(self, sent):
        """ZooKeeper heard from this session at ``sent`` (reactor seconds) at the latest."""
        if self._last_contact is None or sent > self._last_contact:
            self._last_contact = sent
        if self.given_up_while_connected is not None and (
                self.reactor.seconds() - self._last_contact < self.give_up_after - self.probe_interval):
            # The leader hears from the session again, recently enough that the next probe does not give
            # them up at once (a late answer to an old probe does not): the assignment gives them back.
            self.given_up_while_connected = None
            self.request_reconcile()

    def _give_up_partitions(self, why):
        """Stop holding any partition until a current assignment gives some back (``on_assignment({})``).
        If that raises, the partitions count as still held: the next give-up (the next probe, the expiry)
        or assignment tries again."""
        if not self.partitions and not self._holding_unknown:
            return
        self.log.warn("server {id} gives up partitions {partitions}: {why}", id=self.server_id,
                      partitions=sorted(self.partitions.items()), why=why)
        try:
            self._apply_assignment({})
        except Exception:
            self.log.failure("server {id}: giving up the partitions failed; tried again at the next give-up "
                             "or assignment", id=self.server_id)
            return
        if self.on_give_up is not None:
            self.on_give_up(why)

    def _apply_assignment(self, partitions):
        """``on_assignment(partitions)``; ``partitions`` is what the server holds once it returned."""
        self._holding_unknown = True
        self.on_assignment(dict(partitions))
        self._holding_unknown = False
        self.partitions = partitions

    def _prober_failed(self, failure):
        if not self.stopped:
            self.log.failure("server {id}: the ZooKeeper probe stopped", failure, id=self.server_id)

    def _rejoin(self):
        if self.state is not MembershipState.REJOINING:
            return  # a retry timer that fired after another rejoin completed, or after stop()
        if self._rejoining:
            return  # a registration is on its way; _rejoined checks it landed in this session
        self._rejoining = True
        session = self.cluster.zk.session_id
        d = self._register()
        d.addBoth(self._rejoin_done)
        d.addCallbacks(self._rejoined, self._rejoin_failed, callbackArgs=(session,))

    def _rejoin_done(self, result):
        self._rejoining = False
        return result

    def _rejoined(self, _, session):
        if self.state is not MembershipState.REJOINING:
            return
        if self.cluster.zk.session_id != session:
            self._rejoin()  # that session expired too: its descriptor is gone already
            return
        self._enter(MembershipState.MEMBER)
        self.request_reconcile()

    def _rejoin_failed(self, failure):
        if self.state is not MembershipState.REJOINING:
            return
        self.log.warn("server {id} could not register again: {error}; retrying", id=self.server_id,
                      error=failure.getErrorMessage())
        if self.cluster.zk.connected:
            self._rejoin_call = self.reactor.callLater(self.retry_interval, self._rejoin)

    # --- reconciling -----------------------------------------------------------------------------

    def _membership_changed(self, children):
        self.request_reconcile()

    def _assignment_changed(self, data, stat):
        self.request_reconcile()

    def request_reconcile(self):
        """Reconcile now, or once more after the pass in progress."""
        self._reconcile_again = True
        if not self._reconciling:
            self._reconcile_loop()

    @defer.inlineCallbacks
    def _reconcile_loop(self):
        self._reconciling = True
        try:
            while self._reconcile_again and self.state is MembershipState.MEMBER:
                self._reconcile_again = False
                try:
                    yield self._reconcile()
                except BadVersionError:
                    self.log.info("server {id}: the assignment changed while being rewritten; again",
                                  id=self.server_id)
                    self._reconcile_again = True
                except Exception as exc:
                    self._schedule_retry(exc)
                else:
                    self._reconcile_failures = 0
        finally:
            self._reconciling = False

    def _schedule_retry(self, error):
        if self.stopped:
            return      # a pass that failed after stop() (its ZooKeeper client closed): nothing to retry
        if self._reconcile_call is not None and self._reconcile_call.active():
            self.log.warn("server {id}: reconciling the partition assignment failed: {error!r}; a retry is "
                          "already due", id=self.server_id, error=error)
            return
        # Doubling: a failure that lasts (a partition that cannot be opened) is neither a busy loop nor a
        # log line every half second.
        delay = min(self.max_retry_interval, self.retry_interval * 2 ** min(self._reconcile_failures, 30))
        self._reconcile_failures += 1
        self.log.warn("server {id}: reconciling the partition assignment failed: {error!r}; retrying in {delay} s",
                      id=self.server_id, error=error, delay=delay)
        self._reconcile_call = self.reactor.callLater(delay, self.request_reconcile)

    @defer.inlineCallbacks
    def _reconcile(self):
        # The assignment first: its stat's cversion is then never newer than the descriptors read
        # after it, so a membership change in between is seen again at the next watch event.
        registrations, session = self._registrations, self.cluster.zk.session_id
        versioned = yield self.cluster.partition_assignment()
        current, stat = versioned.value, versioned.stat
        descriptors = yield self.cluster.versioned_server_descriptors()
        if not self._still_in(session):
            return      # stopped, or the session changed, while reading: act on nothing read
        self.members = {}
        for _, descriptor in descriptors:
            self.members.setdefault(descriptor.value.server_id, descriptor.value)
        if registrations == self._registrations:
            repaired = yield self._check_registration(descriptors, session, registrations)
            if repaired:
                self._reconcile_again = True   # the descriptors changed: read them again
                return
            if not self._still_in(session):
                return  # the session expired (or the server stopped) while the registration was checked
        if current.cversion == stat.cversion:
            self._adopt(current)
        elif self.is_coordinator:
            yield self._rewrite(current, stat)
        self.reconciles += 1

    def _still_in(self, session):
        """Whether the server is still a member in ZooKeeper session ``session``: what a reconcile pass
        read in that session may be acted on. When not, a pass of the current session follows (the
        session's CONNECTED, a rejoin, or a watch event asks for one)."""
        if self.state is not MembershipState.MEMBER:
            return False
        if self.cluster.zk.session_id != session:
            self._reconcile_again = True
            return False
        return True

    def _check_registration(self, descriptors, session, registrations):
        """Repair this server's registration unless exactly one descriptor of it exists in ``session``,
        :attr:`znode`, with the current content; ``descriptors`` were read after ``registrations``
        registrations. Fires with True when it re-registered."""
        prefix = self.cluster.paths.server_descriptors + "/"
        own = [(prefix + name, versioned.value) for name, versioned in descriptors
               if versioned.value.server_id == self.server_id and versioned.stat.ephemeralOwner == session]
        if own == [(self.znode, self.descriptor)]:
            return defer.succeed(False)

        def repair():
            if registrations != self._registrations or self.state is not MembershipState.MEMBER:
                return False   # a change made while waiting for the lock: what was read is stale
            self.log.warn("server {id}: registration {found} is not the expected {znode} ({descriptor}); "
                          "registering again", id=self.server_id, found=[path for path, _ in own],
                          znode=self.znode, descriptor=self.descriptor)
            return self._replace_descriptors([path for path, _ in own]).addCallback(lambda _: True)
        return self._registration_lock.run(repair)

    @defer.inlineCallbacks
    def _replace_descriptors(self, paths):
        """One multi-op: delete ``paths`` (this server's descriptors) and create one with the current
        content; :attr:`znode` names the new one. Call it holding the registration lock."""
        txn = self.cluster.zk.transaction()
        for path in paths:
            txn.delete(path)
        txn.create(self.cluster.paths.server_descriptor_prefix, self.descriptor.encode(), ephemeral=True,
                   sequence=True)
        results = yield txn.commit()
        if self.stopped:
            yield self._delete_descriptor(results[-1])
            return
        self.znode = results[-1]
        self._registrations += 1
        self.log.info("server {id} registered as {znode} with preferred partitions {preferred}",
                      id=self.server_id, znode=self.znode, preferred=list(self.preferred_partitions))

    @defer.inlineCallbacks
    def _rewrite(self, current, stat):
        new = compute_assignment(stat.cversion, current, self.num_partitions, self.members.values(), self.rng)
        yield self.cluster.write_partition_assignment(new, stat.version)
        self.assignments_written += 1
        self.log.info("server {id} (coordinator) assigned partitions for cversion {cversion}: {servers}",
                      id=self.server_id, cversion=stat.cversion,
                      servers={s: sorted((i.partition_id, i.generation) for i in infos) for s, infos in new.servers})

    def _adopt(self, assignment):
        self.assignment = assignment
        self._check_contact()
        if self.given_up_while_connected is not None:
            return      # read through a follower the leader may not hear: nothing until a probe is answered
        if self._contact_stale():
            # Disconnected now, holding nothing: a reply handed over late must not take partitions on past the
            # give-up time (the session may be expiring). The reconnect's pass applies the assignment.
            return
        mine = partitions_of(assignment, self.server_id)
        if mine == self.partitions and not self._holding_unknown:
            return
        self.log.info("server {id} is assigned partitions {partitions}", id=self.server_id,
                      partitions=sorted(mine.items()))
        # If on_assignment raises, the retried pass applies it again, and a give-up meanwhile still runs.
        self._apply_assignment(mine)

    # --- preferred partitions -----------------------------------------------------------------------

    def _check_partitions(self, partition_ids):
        check_partitions(partition_ids, self.num_partitions)

    def add_preferred_partitions(self, partition_ids):
        """Prefer these partitions too; fires with ``True`` once the descriptor says so."""
        return self._change_preferred(partition_ids, lambda current, ids: current | ids)

    def remove_preferred_partitions(self, partition_ids):
        """Stop preferring these partitions; fires with ``True`` once the descriptor says so."""
        return self._change_preferred(partition_ids, lambda current, ids: current - ids)

    def set_preferred_partitions(self, partition_ids):
        """Replace the preferred partitions and re-register the descriptor (one multi-op: the old
        znode goes, a new one comes), so the coordinator recomputes the assignment. Changes run one
        at a time.

        Fails with :class:`InvalidPartitions` for ids outside the cluster's partitions, or with the
        ZooKeeper error when the change could not be made: the preferred partitions are then
        unchanged (a change whose reply was lost is undone by the next reconcile pass), and the
        caller may try again.
        """
        return self._change_preferred(partition_ids, lambda current, ids: ids)

    def _change_preferred(self, partition_ids, combine):
        """Set the preferred partitions to ``combine(current, ids)``, computed when the change's turn
        comes: one queued behind another starts from that one's outcome, not from the set before it."""
        try:
            self._check_partitions(partition_ids)
        except InvalidPartitions:
            return defer.fail()
        ids = set(partition_ids)
        return self._registration_lock.run(
            lambda: self._set_preferred(tuple(sorted(combine(set(self.preferred_partitions), ids)))))

    @defer.inlineCallbacks
    def _set_preferred(self, preferred):
        if preferred == self.preferred_partitions:
            return True
        previous, self.preferred_partitions = self.preferred_partitions, preferred
        if self.state is not MembershipState.MEMBER or self.znode is None:
            return True  # registering (again) will use the new descriptor
        try:
            yield self._replace_descriptors([self.znode])
        except Exception:
            self.preferred_partitions = previous
            self.request_reconcile()   # whatever happened in ZooKeeper, the next pass makes it match
            raise
        return True
