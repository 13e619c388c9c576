"""TLS (waltz.tls): the keys and their checks, and mutual TLS between Waltz protocols on 127.0.0.1."""

import datetime
import os

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from twisted.internet import defer, endpoints
from twisted.internet.protocol import Factory

from waltz.client.config import client_config
from waltz.config import ConfigError, build_config
from waltz.local.pki import LocalPKI
from waltz.protocols import client_messages as m
from waltz.protocols.base import WaltzProtocol
from waltz.server.config import SERVER_KEYS, check_server_config
from waltz.storage.config import STORAGE_KEYS, load_storage_config
from waltz.tls import client_endpoint, load_tls, server_factory, tls_keys

PREFIX = "server.ssl."
ZOOKEEPER = {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/waltz"}


@pytest.fixture
def pki(tmp_path):
    return LocalPKI(str(tmp_path / "pki"))


def tls_of(keys, prefix=PREFIX):
    return load_tls(build_config(keys, tls_keys(prefix)), prefix)


# --- keys and their checks --------------------------------------------------------------------


def test_no_keys_means_plain_tcp():
    assert tls_of({}) is None


def test_a_full_set_loads_the_certificate_and_roots(pki):
    tls = tls_of(pki.keys(PREFIX, "server-0"))
    assert tls.subject == "CN=server-0"
    assert len(tls.trust_roots) == 1 and tls.chain == ()


@pytest.mark.parametrize("missing", ["certificate", "privateKey", "trustRoots"])
def test_a_key_missing_beside_the_others_is_named(pki, missing):
    keys = pki.keys(PREFIX, "server-0")
    del keys[PREFIX + missing]
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + missing
    assert "required when" in str(caught.value)


def test_an_unreadable_file_is_named_with_its_key(pki, tmp_path):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + "trustRoots"] = str(tmp_path / "nowhere.pem")
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + "trustRoots"
    assert "nowhere.pem" in str(caught.value) and "cannot read" in str(caught.value)


def test_a_file_without_a_certificate_is_refused(pki, tmp_path):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + "certificate"] = keys[PREFIX + "privateKey"]     # a key where the certificate belongs
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + "certificate"
    assert "no PEM certificate" in str(caught.value)


def test_a_damaged_certificate_is_refused(pki, tmp_path):
    keys = pki.keys(PREFIX, "server-0")
    with open(keys[PREFIX + "trustRoots"], "rb") as stream:
        text = stream.read()
    damaged = tmp_path / "damaged.pem"
    damaged.write_bytes(text.replace(b"\n", b"\nAAAA", 2))
    keys[PREFIX + "trustRoots"] = str(damaged)
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + "trustRoots"
    assert "not a valid PEM certificate" in str(caught.value)


def test_a_key_that_is_not_a_private_key_is_refused(pki):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + "privateKey"] = keys[PREFIX + "certificate"]
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + "privateKey"


def test_a_private_key_of_another_certificate_is_refused(pki):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + "privateKey"] = pki.keys(PREFIX, "server-1")[PREFIX + "privateKey"]
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + "privateKey"
    assert "is not the key of the certificate" in str(caught.value)


def self_signed_outside_validity(keys, tmp_path, valid_from_days, valid_to_days):
    """A certificate of the key in ``keys`` valid only from/to those days from now, written to a file: its path."""
    with open(keys[PREFIX + "privateKey"], "rb") as stream:
        key = serialization.load_pem_private_key(stream.read(), password=None)
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "old")])
    outside = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
               .serial_number(1).not_valid_before(now + datetime.timedelta(days=valid_from_days))
               .not_valid_after(now + datetime.timedelta(days=valid_to_days)).sign(key, hashes.SHA256()))
    path = tmp_path / "outside.pem"
    path.write_bytes(outside.public_bytes(serialization.Encoding.PEM))
    return str(path)


@pytest.mark.parametrize("suffix, valid_from_days, valid_to_days, problem", [
    ("certificate", -30, -1, "the certificate in %s expired on"),
    ("certificate", 2, 30, "the certificate in %s is not valid before"),
    ("trustRoots", -30, -1, "no certificate in %s is valid now (CN=old expired on"),
    ("trustRoots", 2, 30, "no certificate in %s is valid now (CN=old is not valid before")])
def test_a_certificate_or_trust_roots_outside_their_validity_are_refused(pki, tmp_path, suffix, valid_from_days,
                                                                        valid_to_days, problem):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + suffix] = self_signed_outside_validity(keys, tmp_path, valid_from_days, valid_to_days)
    with pytest.raises(ConfigError) as caught:
        tls_of(keys)
    assert caught.value.key == PREFIX + suffix and problem % keys[PREFIX + suffix] in str(caught.value)


def test_trust_roots_with_one_valid_root_among_them_are_accepted(pki, tmp_path):
    keys = pki.keys(PREFIX, "server-0")
    keys[PREFIX + "trustRoots"] = self_signed_outside_validity(keys, tmp_path, -30, -1)
    # One valid root among them is enough (a CA being rolled over).
    with open(keys[PREFIX + "trustRoots"], "ab") as stream, open(pki.ca_path, "rb") as ca:
        stream.write(ca.read())
    assert tls_of(keys).trust_roots[1].subject.rfc4514_string() == "CN=Waltz local CA"


def test_the_daemons_and_the_client_check_their_files_when_the_config_is_read(pki, tmp_path):
    broken = dict(pki.keys("storage.ssl.", "x"), **{"storage.ssl.trustRoots": str(tmp_path / "missing.pem")})
    storage_file = tmp_path / "storage.yaml"
    storage_file.write_text("".join("%s: %s\n" % item for item in dict(
        ZOOKEEPER, **{"storage.directory": str(tmp_path / "data")}, **broken).items()))
    with pytest.raises(ConfigError) as caught:
        load_storage_config(str(storage_file))
    assert caught.value.key == "storage.ssl.trustRoots"

    server = dict(ZOOKEEPER, **pki.keys("server.ssl.", "s"), **{"storage.ssl.certificate": "/nowhere.pem"})
    with pytest.raises(ConfigError) as caught:
        check_server_config(build_config(server, SERVER_KEYS))
    assert caught.value.key == "storage.ssl.privateKey"     # the first key missing beside the one given

    client = dict(ZOOKEEPER, **pki.keys("client.ssl.", "c"))
    client["client.ssl.privateKey"] = pki.keys("client.ssl.", "d")["client.ssl.privateKey"]
    with pytest.raises(ConfigError) as caught:
        client_config(client)
    assert caught.value.key == "client.ssl.privateKey"
    assert client_config(dict(ZOOKEEPER, **pki.keys("client.ssl.", "c")))["client.ssl.trustRoots"] == pki.ca_path
    assert "storage.ssl.certificate" in {key.name for key in STORAGE_KEYS}


# --- the handshake, on 127.0.0.1 --------------------------------------------------------------


#: Every :class:`_Peer` of the running test (see :func:`_settle_peers`).
_PEERS = []


@pytest.fixture(autouse=True)
def _settle_peers():
    """After each test, the failed Hello of a peer no test waited for (a side of a refused handshake) is taken,
    instead of being logged as an unhandled error when the peer is collected, during some later test."""
    yield
    while _PEERS:
        _PEERS.pop().made_ready.addErrback(lambda failure: None)


class _Peer(WaltzProtocol):
    """Either side of a client-family connection: records its handshake and its close."""

    codec = m.CLIENT_CODEC

    def __init__(self):
        super().__init__()
        self.made_ready = defer.Deferred()
        self.closed_with = defer.Deferred()
        _PEERS.append(self)

    def connectionReady(self):
        self.made_ready.callback(self.version)

    def connectionClosed(self, reason):
        if not self.made_ready.called:
            self.made_ready.errback(reason)
        self.closed_with.callback(reason.value)


class _ServerPeer(_Peer):
    hello_name = "Waltz Server"
    receives = None      # (any message: this test sends none)
    # As the daemons' connections: stop reading while the transport cannot take writes (the TLS handshake
    # holds the Hello back, and a pause passed down to TCP then would never read the handshake's answer).
    pause_reading_while_unwritable = True


class _ClientPeer(_Peer):
    hello_name = "Waltz Client"
    receives = m.CLIENT_CODEC.replies


class _Listener:
    """A TLS (or plain) listening port of :class:`_ServerPeer` s on 127.0.0.1 (with ``liveness`` applied)."""

    def __init__(self, reactor, tls, liveness=None):
        self.accepted = []
        factory = Factory.forProtocol(_ServerPeer)
        build = factory.buildProtocol

        def record(addr):
            proto = build(addr)
            if liveness is not None:
                liveness.apply(proto)
            self.accepted.append(proto)
            return proto
        factory.buildProtocol = record
        self.port = reactor.listenTCP(0, server_factory(factory, tls), interface="127.0.0.1")

    def connect(self, reactor, tls):
        return client_endpoint(reactor, "127.0.0.1", self.port.getHost().port, 5, tls).connect(
            Factory.forProtocol(_ClientPeer))


@pytest_twisted.ensureDeferred
async def test_mutual_tls_completes_the_hello_both_ways(pki):
    from twisted.internet import reactor
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")))
    try:
        client = await listener.connect(reactor, tls_of(pki.keys(PREFIX, "client-0")))
        version = await client.made_ready
        assert version == max(m.CLIENT_CODEC.versions)
        assert await listener.accepted[0].made_ready == version
        # the peer's certificate is the client's: the server authenticated it
        peer = listener.accepted[0].transport.getPeerCertificate()
        assert peer.to_cryptography().subject.rfc4514_string() == "CN=client-0"
        client.transport.loseConnection()
        await client.closed_with
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


async def _refused(reactor, listener, tls):
    """Connect with ``tls``: the connection closes, neither side completes its Hello."""
    try:
        client = await listener.connect(reactor, tls)
    except Exception:
        return          # (refused during the connect itself)
    with pytest.raises(Exception):
        await client.made_ready
    await client.closed_with
    for accepted in listener.accepted:
        await accepted.closed_with
    assert all(proto.version is None for proto in listener.accepted + [client])


@pytest.mark.parametrize("trusting", ["its own CA", "the cluster's CA"])
@pytest_twisted.ensureDeferred
async def test_a_certificate_of_another_ca_is_refused(pki, tmp_path, trusting):
    from twisted.internet import reactor
    keys = LocalPKI(str(tmp_path / "other-ca")).keys(PREFIX, "intruder")
    if trusting == "the cluster's CA":
        keys[PREFIX + "trustRoots"] = pki.ca_path     # it accepts the server: only the server can refuse it
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")))
    try:
        await _refused(reactor, listener, tls_of(keys))
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


@pytest_twisted.ensureDeferred
async def test_a_plain_client_gets_nothing_from_a_tls_port(pki):
    from twisted.internet import reactor
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")))
    try:
        await _refused(reactor, listener, None)
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


@pytest_twisted.ensureDeferred
async def test_a_tls_client_does_not_talk_to_a_plain_port(pki):
    from twisted.internet import reactor
    listener = _Listener(reactor, None)
    try:
        await _refused(reactor, listener, tls_of(pki.keys(PREFIX, "client-0")))
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


def test_private_keys_are_written_for_the_owner_only(pki):
    _, key_path = pki.issue("server-9")
    assert os.stat(key_path).st_mode & 0o077 == 0


@pytest.mark.parametrize("verify", [True, False])
@pytest_twisted.ensureDeferred
async def test_a_connection_checks_that_the_certificate_names_the_host_it_connects_to(pki, verify):
    """Any certificate of the cluster's CA passes the chain check: with verifyHostname (the default) a client's
    or a storage node's certificate cannot stand in for the server it connects to."""
    from twisted.internet import reactor
    cert, key = pki.issue("elsewhere", hosts=("elsewhere.example",))
    listener = _Listener(reactor, tls_of({PREFIX + "certificate": cert, PREFIX + "privateKey": key,
                                          PREFIX + "trustRoots": pki.ca_path}))
    client_keys = dict(pki.keys(PREFIX, "client-0"), **{PREFIX + "verifyHostname": verify})
    try:
        if verify:
            await _refused(reactor, listener, tls_of(client_keys))
        else:
            client = await listener.connect(reactor, tls_of(client_keys))
            assert await client.made_ready == max(m.CLIENT_CODEC.versions)
            client.close("done", expected=True)
            await client.closed_with
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


def test_verify_hostname_is_on_unless_set_off(pki):
    assert tls_of(pki.keys(PREFIX, "a")).verify_hostname is True
    assert tls_of(dict(pki.keys(PREFIX, "a"), **{PREFIX + "verifyHostname": "false"})).verify_hostname is False
    with pytest.raises(ConfigError, match="config key 'server.ssl.verifyHostname'"):
        tls_of(dict(pki.keys(PREFIX, "a"), **{PREFIX + "verifyHostname": "sometimes"}))


@pytest.mark.parametrize("tls", [True, False])
@pytest_twisted.ensureDeferred
async def test_a_peer_that_never_completes_the_handshake_is_dropped_by_the_idle_timeout(pki, tls):
    """The Hello waits for the TLS handshake, and a daemon's connection stops reading while its Hello waits:
    that pause must not count as this side's own silence, or a peer that never finishes its handshake would
    hold the connection (and a file descriptor) for good."""
    from twisted.internet import reactor, task
    from twisted.internet.protocol import Protocol
    from waltz.protocols.base import Liveness
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")) if tls else None,
                         Liveness(reactor, interval=0.1, idle_timeout=0.3))
    silent = await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", listener.port.getHost().port).connect(
        Factory.forProtocol(Protocol))
    try:
        for _ in range(40):
            if listener.accepted and listener.accepted[0].closed:
                break
            await task.deferLater(reactor, 0.05, lambda: None)
        assert listener.accepted and listener.accepted[0].closed
    finally:
        silent.transport.abortConnection()
        await defer.maybeDeferred(listener.port.stopListening)


@pytest_twisted.ensureDeferred
async def test_a_connect_fails_with_the_handshake_and_the_reason_is_logged(pki, tmp_path):
    """A refused handshake is a failed connection attempt (so a reconnecting caller backs off), and says why."""
    from twisted.internet import reactor
    from twisted.logger import globalLogPublisher
    events = []
    globalLogPublisher.addObserver(events.append)
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")))
    try:
        with pytest.raises(Exception) as caught:
            await listener.connect(reactor, tls_of(LocalPKI(str(tmp_path / "other")).keys(PREFIX, "c")))
        assert "certificate verify failed" in str(caught.value)
    finally:
        globalLogPublisher.removeObserver(events.append)
        await defer.maybeDeferred(listener.port.stopListening)
    lines = [e.get("log_format", "").format(**{k: v for k, v in e.items() if isinstance(k, str)})
             for e in events if e.get("log_format", "").startswith("TLS handshake")]
    assert any("127.0.0.1" in line and "certificate verify failed" in line for line in lines), lines


@pytest_twisted.ensureDeferred
async def test_a_close_while_reading_is_paused_finishes_at_once_and_cleanly(pki):
    """A daemon's connection stops reading while its peer has not read what it wrote; closing it must still
    read the peer's answer to the TLS close alert, or the close would wait for the 10 s abort."""
    from twisted.internet import reactor
    from twisted.internet.error import ConnectionDone
    from waltz.protocols.framing import encode_frame_header
    listener = _Listener(reactor, tls_of(pki.keys(PREFIX, "server-0")))
    try:
        client = await listener.connect(reactor, tls_of(pki.keys(PREFIX, "client-0")))
        await client.made_ready
        server = listener.accepted[0]
        await server.made_ready
        server.transport.write(encode_frame_header(server.codec.magic, server.version, 0) * 100_000)
        assert not server.writable and server.reading_paused      # 700 KB: the peer has not read it yet
        started = reactor.seconds()
        server.close("done", expected=True)
        reason = await server.closed_with
        assert reactor.seconds() - started < 3
        assert isinstance(reason, ConnectionDone), reason
        await client.closed_with
    finally:
        await defer.maybeDeferred(listener.port.stopListening)


@pytest_twisted.ensureDeferred
async def test_a_connect_cancelled_during_the_handshake_aborts_it_once(pki):
    """A caller's timeout cancels the connect while the handshake waits (a peer that never answers it)."""
    from twisted.internet import reactor, task
    from twisted.internet.protocol import Protocol
    from twisted.logger import globalLogPublisher
    errors = []

    def observe(event):
        if event.get("log_failure") is not None or event.get("isError"):
            errors.append(event)
    silent = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")   # accepts, says nothing
    globalLogPublisher.addObserver(observe)
    try:
        outcome = []
        d = client_endpoint(reactor, "127.0.0.1", silent.getHost().port, 5,
                            tls_of(pki.keys(PREFIX, "client-0"))).connect(Factory.forProtocol(_ClientPeer))
        d.addBoth(outcome.append)
        await task.deferLater(reactor, 0.2, lambda: None)
        assert outcome == []
        d.cancel()
        await task.deferLater(reactor, 0.2, lambda: None)      # the abort's connectionLost: no second answer
        assert len(outcome) == 1 and outcome[0].check(defer.CancelledError)
        assert errors == []
    finally:
        globalLogPublisher.removeObserver(observe)
        await defer.maybeDeferred(silent.stopListening)


def _certificate_with_usage(pki, tmp_path, usage):
    """The keys of a certificate of ``pki``'s CA for 127.0.0.1 whose extended key usage is ``usage``."""
    from cryptography.x509.oid import ExtendedKeyUsageOID
    keys = pki.keys(PREFIX, "server-0")
    with open(keys[PREFIX + "privateKey"], "rb") as stream:
        key = serialization.load_pem_private_key(stream.read(), password=None)
    with open(os.path.join(pki.directory, "ca-key.pem"), "rb") as stream:
        ca_key = serialization.load_pem_private_key(stream.read(), password=None)
    with open(pki.ca_path, "rb") as stream:
        ca = x509.load_pem_x509_certificate(stream.read())
    usages = {"serverAuth": [ExtendedKeyUsageOID.SERVER_AUTH], "clientAuth": [ExtendedKeyUsageOID.CLIENT_AUTH],
              "both": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]}[usage]
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(
        x509.oid.NameOID.COMMON_NAME, "server-0")])).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(7).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(ca_key, hashes.SHA256()))
    path = tmp_path / ("%s.pem" % usage)
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    keys[PREFIX + "certificate"] = str(path)
    return keys


@pytest.mark.parametrize("usage, role, refused", [
    ("serverAuth", "connects", True), ("serverAuth", "serves", False),
    ("clientAuth", "serves", True), ("clientAuth", "connects", False), ("both", "serves", False)])
def test_a_certificate_whose_extended_key_usage_does_not_allow_its_role_is_refused(pki, tmp_path, usage, role,
                                                                                    refused):
    """A server's storage.ssl.* certificate opens connections: a serverAuth-only one (what many CAs issue by
    default) would fail every handshake with its storage nodes."""
    config = build_config(_certificate_with_usage(pki, tmp_path, usage), tls_keys(PREFIX))
    if refused:
        with pytest.raises(ConfigError) as caught:
            load_tls(config, PREFIX, role)
        assert caught.value.key == PREFIX + "certificate" and "extended key usage" in str(caught.value)
    else:
        assert load_tls(config, PREFIX, role).subject == "CN=server-0"


def test_the_server_checks_each_certificate_for_its_role(pki, tmp_path):
    server_only = {k.replace(PREFIX, "storage.ssl."): v
                   for k, v in _certificate_with_usage(pki, tmp_path, "serverAuth").items()}
    with pytest.raises(ConfigError) as caught:
        check_server_config(build_config(dict(ZOOKEEPER, **server_only), SERVER_KEYS))
    assert caught.value.key == "storage.ssl.certificate"
    serving = {k.replace("storage.ssl.", PREFIX): v for k, v in server_only.items()}
    assert check_server_config(build_config(dict(ZOOKEEPER, **serving), SERVER_KEYS))
