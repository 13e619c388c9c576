"""Optional TLS on every Waltz connection, with mutual authentication against a cluster's own CA.

The original Waltz took ``server.ssl.*``, ``storage.ssl.*`` and ``client.ssl.*`` keys naming Java key and
trust stores. Here each prefix takes three PEM files (``docs/operations.md``, "TLS"):

* ``<prefix>certificate``: this process's certificate, optionally followed by its intermediate CAs;
* ``<prefix>privateKey``: the certificate's private key (unencrypted);
* ``<prefix>trustRoots``: the CA certificates a peer's certificate must chain to.

Given all three, a listening port accepts only peers presenting a certificate that chains to the trust roots,
and a connection verifies the listening side's certificate the same way (mutual TLS), and by default also that
it names the host connected to (``<prefix>verifyHostname``; the original checked the chain only). A cluster's
members and clients are whoever holds a certificate of its CA, so the CA must be one issued for the cluster
alone. None of the three given means plain TCP. TLS sits below the framing and the Hello: the wire formats are
unchanged.

Everything is read and checked when the configuration is loaded, so a missing file, a malformed PEM, a key
that does not match its certificate, a certificate or trust roots out of their validity, or a certificate whose
extended key usage does not allow its role stops the process before it binds anything, naming the key.
"""

import datetime
import functools
import os

import attr
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.internet import defer, endpoints, interfaces, ssl
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from zope.interface import implementer

from waltz.config import ConfigError, Key

#: The three keys under a TLS prefix, in the order their problems are reported.
SUFFIXES = ("certificate", "privateKey", "trustRoots")

_DOCS = {
    "certificate": "PEM file: this process's TLS certificate (then its intermediate CAs); with privateKey and "
                   "trustRoots, connections use mutual TLS",
    "privateKey": "PEM file: the private key of the certificate (unencrypted)",
    "trustRoots": "PEM file: the CA certificates a peer's certificate must chain to",
}

_PEM_CERTIFICATE_END = b"-----END CERTIFICATE-----"


def pem_path(value):
    """A file path (made absolute); it is read when the configuration is checked."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected the path of a PEM file")
    if "\0" in value:
        raise ValueError("a path cannot contain a NUL character")
    return os.path.abspath(os.path.expanduser(value.strip()))


#: The key under a TLS prefix that says whether a connection this process opens checks the peer's host name.
VERIFY_HOSTNAME = "verifyHostname"


def tls_keys(prefix):
    """The optional :class:`~waltz.config.Key` entries under ``prefix`` (e.g. ``"server.ssl."``): the three
    files, and ``verifyHostname``."""
    return tuple(Key(prefix + suffix, pem_path, None, _DOCS[suffix]) for suffix in SUFFIXES) + (
        Key(prefix + VERIFY_HOSTNAME, bool, True,
            "whether a connection this process opens checks that the peer's certificate names the host it "
            "connects to (false: any certificate of the trust roots is accepted, as in the original)"),)


def _read(path, key):
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as exc:
        raise ConfigError("config key '%s': cannot read %s: %s" % (key, path, exc.strerror), key) from None


def _certificates(data, path, key):
    """Every certificate of a PEM file, in order; ConfigError naming ``key`` when there is none or one is bad."""
    chunks = [chunk + _PEM_CERTIFICATE_END for chunk in data.split(_PEM_CERTIFICATE_END)[:-1]]
    if not chunks:
        raise ConfigError("config key '%s': %s holds no PEM certificate" % (key, path), key)
    certificates = []
    for number, chunk in enumerate(chunks, 1):
        try:
            certificates.append(x509.load_pem_x509_certificate(chunk.strip()))
        except ValueError:
            raise ConfigError("config key '%s': certificate %d in %s is not a valid PEM certificate"
                              % (key, number, path), key) from None
    return certificates


def _private_key(data, path, key):
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ConfigError("config key '%s': %s is not an unencrypted PEM private key" % (key, path), key) from None


@attr.s(frozen=True, eq=False, repr=False)
class TLSConfig:
    """A process's TLS identity and trust roots: makes the TLS options of its listening ports and of the
    connections it opens (both require and verify the peer's certificate)."""

    prefix = attr.ib()
    certificate = attr.ib()         # a cryptography x509.Certificate
    chain = attr.ib()               # intermediate CAs sent after the certificate: tuple of x509.Certificate
    private_key = attr.ib()         # a cryptography private key
    trust_roots = attr.ib()         # tuple of x509.Certificate
    #: Whether the connections this process opens check that the peer's certificate names the host.
    verify_hostname = attr.ib(default=True)
    _by_hostname = attr.ib(factory=dict, init=False, repr=False)    # host -> its client connection creator

    def __repr__(self):
        return "<TLSConfig %s subject=%s>" % (self.prefix, self.subject)

    @property
    def subject(self) -> str:
        """The certificate's subject, e.g. ``CN=storage-0``."""
        return self.certificate.subject.rfc4514_string()

    @functools.cached_property
    def options(self):
        """The :class:`twisted.internet.ssl.CertificateOptions` for either side of a connection: present the
        certificate, and require the peer's, verified against the trust roots. (One for all the connections of
        a process: it makes its OpenSSL context once.)"""
        return ssl.CertificateOptions(trustRoot=self._trust_root(), **self._identity())

    def _identity(self):
        return dict(privateKey=self.private_key, certificate=self.certificate, extraCertChain=list(self.chain),
                    raiseMinimumTo=ssl.TLSVersion.TLSv1_2)

    def _trust_root(self):
        return ssl.trustRootFromCertificates(
            [ssl.Certificate(crypto.X509.from_cryptography(root)) for root in self.trust_roots])

    def client_options(self, hostname):
        """What a connection to ``hostname`` negotiates with: :attr:`options`, and with :attr:`verify_hostname`
        a check that the peer's certificate names ``hostname`` (a DNS name or an IP address, in its subject
        alternative names), as a web client checks a server's."""
        if not self.verify_hostname:
            return self.options
        creator = self._by_hostname.get(hostname)
        if creator is None:
            creator = self._by_hostname[hostname] = ssl.optionsForClientTLS(
                hostname, trustRoot=self._trust_root(), extraCertificateOptions=self._identity())
        return creator

    def wrap_client(self, endpoint, hostname):
        """``endpoint`` (a client endpoint to ``hostname``) with TLS over it."""
        return _TLSClientEndpoint(self.client_options(hostname), endpoint)

    def wrap_server_factory(self, factory):
        """A factory for a listening port that speaks TLS and hands the decrypted stream to ``factory``."""
        return _TLSFactory(self.options, False, factory)


class _TLSProtocol(TLSMemoryBIOProtocol):
    """TLS under a Waltz protocol, pausing and closing as a TCP transport does.

    A Waltz protocol registers itself as its transport's streaming producer (to pause its feeds while the
    peer reads slowly), and the daemons' connections stop reading while they cannot write. Twisted's TLS
    transport differs from TCP in two ways that matter here:

    * it pauses its producer while the handshake is under way (what the protocol writes first, its Hello,
      waits for the handshake), and a protocol that then stops reading (its ``pauseProducing`` of the
      transport goes to the TCP connection underneath) would never read the handshake's answer. So a pause
      of reading before the handshake is done is not passed down: the protocol can have received nothing
      yet, so its only reason to pause is that wait, which ends with the handshake;
    * its ``loseConnection`` waits for the producer to unregister, where TCP closes once its buffer is
      written, so closes that do not go through :meth:`WaltzProtocol.close` (a reconnecting service
      stopping, a tool hanging up) would never finish. Here the producer is unregistered first. And it
      closes once the peer answered its close alert, which a connection whose reading is paused (its
      peer reads slowly) would never read: reading resumes for the close.

    The handshake's outcome is told to whoever waits for it (:meth:`when_handshake_done`: a connecting
    side's endpoint), and a failed handshake is logged with its reason, on both sides: an unknown CA, a
    host name the certificate does not name, a plain TCP peer.
    """

    log = Logger()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._handshake_reported = False
        self._handshake_waiters = []

    def pauseProducing(self):
        """The protocol stops reading (see the class docstring for the handshake)."""
        if self._handshakeDone:
            self.transport.pauseProducing()

    def resumeProducing(self):
        self.transport.resumeProducing()

    def loseConnection(self):
        if not self.disconnecting and self.connected:
            if self._producer is not None:
                self.unregisterProducer()
            self.transport.resumeProducing()     # to read the peer's answer to the close alert
        super().loseConnection()

    def when_handshake_done(self):
        """A Deferred firing with the application's protocol once the handshake completed, or failing with
        its reason if the connection closes first; cancelling it aborts the connection."""
        if self._handshake_reported:
            return defer.succeed(self.wrappedProtocol) if self._handshakeDone else defer.fail(
                ConnectionClosedDuringHandshake())
        d = defer.Deferred(lambda _: self.abortConnection())
        self._handshake_waiters.append(d)
        return d

    def dataReceived(self, data):
        super().dataReceived(data)
        if self._handshakeDone and not self._handshake_reported:
            self._report_handshake(None)

    def connectionLost(self, reason):
        if not self._handshake_reported:
            self._report_handshake(getattr(self, "_reason", None) or reason)
        super().connectionLost(reason)

    def _report_handshake(self, failure):
        self._handshake_reported = True
        waiters, self._handshake_waiters = self._handshake_waiters, []
        if failure is not None:
            self.log.warn("TLS handshake with {peer} failed: {reason}", peer=_address(self.getPeer()),
                          reason=_reason_text(failure))
        for d in waiters:
            if d.called:
                continue        # cancelled (the connection is being aborted)
            if failure is None:
                d.callback(self.wrappedProtocol)
            else:
                d.errback(failure)


class _TLSFactory(TLSMemoryBIOFactory):
    protocol = _TLSProtocol
    noisy = False


@implementer(interfaces.IStreamClientEndpoint)
class _TLSClientEndpoint:
    """A client endpoint speaking TLS (:class:`_TLSProtocol`) over another endpoint; fires with the
    application's protocol, as ``wrapClientTLS`` does."""

    def __init__(self, options, endpoint):
        self._options = options
        self._endpoint = endpoint

    def connect(self, factory):
        """Fires with the application's protocol once the TLS handshake completed (a refused handshake is a
        failed connection attempt, so a caller's back-off applies)."""
        d = self._endpoint.connect(_TLSFactory(self._options, True, factory))
        return d.addCallback(lambda tls_protocol: tls_protocol.when_handshake_done())


class ConnectionClosedDuringHandshake(Exception):
    """The connection closed before its TLS handshake completed."""


def _address(address):
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    return "%s:%s" % (host, port) if host is not None else str(address)


def _reason_text(failure):
    """One line for a failed handshake: OpenSSL's reasons (e.g. "certificate verify failed"), or the error."""
    value = failure.value
    if isinstance(value, SSL.Error) and value.args and isinstance(value.args[0], list):
        reasons = [item[-1] for item in value.args[0] if isinstance(item, tuple) and item and item[-1]]
        if reasons:
            return "; ".join(reasons)
    return failure.getErrorMessage() or type(value).__name__


#: The roles a certificate plays (``load_tls``'s ``role``): serving a listening port, or opening connections.
SERVES, CONNECTS = "serves", "connects"

_ROLE_USAGE = {SERVES: (x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, "serverAuth", "serve a port"),
               CONNECTS: (x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH, "clientAuth", "open connections")}


def _check_usage(certificate, role, path, key):
    """A certificate whose extended key usage does not allow ``role`` would fail every handshake."""
    if role is None:
        return
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return          # no extended key usage: any use
    oid, name, what = _ROLE_USAGE[role]
    if oid not in usage and x509.oid.ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in usage:
        raise ConfigError("config key '%s': the certificate in %s is used to %s, but its extended key usage does "
                          "not include %s" % (key, path, what, name), key)


def _validity(certificate, now):
    """Why ``certificate`` is not valid at ``now``, e.g. ``CN=old CA expired on 2025-01-01T00:00:00+00:00``."""
    subject = certificate.subject.rfc4514_string()
    if certificate.not_valid_after_utc <= now:
        return "%s expired on %s" % (subject, certificate.not_valid_after_utc.isoformat())
    return "%s is not valid before %s" % (subject, certificate.not_valid_before_utc.isoformat())


def load_tls(config, prefix, role=None):
    """The :class:`TLSConfig` under ``prefix`` of a validated ``config`` (keys from :func:`tls_keys`), or None
    when none of its keys is set. :class:`~waltz.config.ConfigError` names the key of anything wrong: a key
    missing beside the others, an unreadable file, a malformed PEM, a key that is not the certificate's, a
    certificate out of its validity, trust roots none of which is valid now, or a certificate whose extended key
    usage does not allow ``role`` (:data:`SERVES` or :data:`CONNECTS`)."""
    paths = {suffix: config.get(prefix + suffix) for suffix in SUFFIXES}
    given = [suffix for suffix in SUFFIXES if paths[suffix] is not None]
    if not given:
        return None
    for suffix in SUFFIXES:
        if paths[suffix] is None:
            key = prefix + suffix
            raise ConfigError("config key '%s' is required when '%s' is set: TLS needs %s" % (
                key, prefix + given[0], ", ".join(prefix + s for s in SUFFIXES)), key)
    cert_key, private_key_key, roots_key = (prefix + suffix for suffix in SUFFIXES)
    certificates = _certificates(_read(paths["certificate"], cert_key), paths["certificate"], cert_key)
    private_key = _private_key(_read(paths["privateKey"], private_key_key), paths["privateKey"], private_key_key)
    roots = _certificates(_read(paths["trustRoots"], roots_key), paths["trustRoots"], roots_key)
    now = datetime.datetime.now(datetime.timezone.utc)
    if not any(root.not_valid_before_utc <= now < root.not_valid_after_utc for root in roots):
        raise ConfigError("config key '%s': no certificate in %s is valid now (%s): no peer's certificate could "
                          "chain to them" % (roots_key, paths["trustRoots"], "; ".join(
                              _validity(root, now) for root in roots)), roots_key)
    expiry, start = certificates[0].not_valid_after_utc, certificates[0].not_valid_before_utc
    if expiry <= now:
        raise ConfigError("config key '%s': the certificate in %s expired on %s" % (
            cert_key, paths["certificate"], expiry.isoformat()), cert_key)
    if start > now:
        raise ConfigError("config key '%s': the certificate in %s is not valid before %s (is this machine's clock "
                          "right?)" % (cert_key, paths["certificate"], start.isoformat()), cert_key)
    _check_usage(certificates[0], role, paths["certificate"], cert_key)
    context = SSL.Context(SSL.TLS_METHOD)
    try:
        context.use_certificate(certificates[0])
        context.use_privatekey(private_key)
        context.check_privatekey()
    except SSL.Error:
        raise ConfigError("config key '%s': the private key in %s is not the key of the certificate in %s"
                          % (private_key_key, paths["privateKey"], paths["certificate"]), private_key_key) from None
    return TLSConfig(prefix, certificates[0], tuple(certificates[1:]), private_key, tuple(roots),
                     config.get(prefix + VERIFY_HOSTNAME, True))


def client_endpoint(reactor, host, port, timeout, tls=None):
    """An endpoint connecting to ``host:port``, through TLS when ``tls`` (a :class:`TLSConfig`) is given."""
    endpoint = endpoints.HostnameEndpoint(reactor, host, port, timeout=timeout)
    return endpoint if tls is None else tls.wrap_client(endpoint, host)


def server_factory(factory, tls=None):
    """``factory`` for a listening port, wrapped in TLS when ``tls`` (a :class:`TLSConfig`) is given."""
    return factory if tls is None else tls.wrap_server_factory(factory)
