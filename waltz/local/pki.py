"""A private certificate authority for a local cluster: a CA and one certificate per process, as PEM files.

For development clusters (``waltz dev up --tls``) and tests. A production cluster's certificates come from
the operator's own CA (``docs/operations.md``, "TLS"); the files here have the same form: a certificate
(followed by nothing: the CA signs it directly), its unencrypted private key, and the CA's certificate as
the trust roots.
"""

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from waltz.config import build_config
from waltz.tls import CONNECTS, SUFFIXES, load_tls, tls_keys

#: How long the certificates made here are valid.
VALIDITY = datetime.timedelta(days=365)


def _name(common_name):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path, data, private=False):
    """Write ``data`` to ``path`` (owner-only when ``private``) through a temporary file, then rename."""
    temporary = path + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)
    os.replace(temporary, path)


def _key_pem(key):
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class LocalPKI:
    """A CA kept in ``directory`` (made on first use) that issues certificates for local processes.

    ``issue(name)`` writes ``<name>.pem`` and ``<name>-key.pem`` beside ``ca.pem``; :meth:`keys` gives the
    three config keys of a TLS prefix for one of them.
    """

    def __init__(self, directory, name="Waltz local CA"):
        self.directory = os.path.abspath(directory)
        self.ca_path = os.path.join(self.directory, "ca.pem")
        self._ca_key_path = os.path.join(self.directory, "ca-key.pem")
        os.makedirs(self.directory, exist_ok=True)
        if os.path.exists(self.ca_path) and os.path.exists(self._ca_key_path):
            with open(self.ca_path, "rb") as stream:
                self._ca = x509.load_pem_x509_certificate(stream.read())
            with open(self._ca_key_path, "rb") as stream:
                self._ca_key = serialization.load_pem_private_key(stream.read(), password=None)
        else:
            self._ca_key = ec.generate_private_key(ec.SECP256R1())
            self._ca = self._sign(_name(name), self._ca_key.public_key(), self._ca_key, _name(name), ca=True)
            _write(self._ca_key_path, _key_pem(self._ca_key), private=True)
            _write(self.ca_path, self._ca.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _sign(subject, public_key, signing_key, issuer, ca=False, hosts=()):
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            if hosts:
                builder = builder.add_extension(x509.SubjectAlternativeName(
                    [_general_name(host) for host in hosts]), critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    def issue(self, name, hosts=("127.0.0.1", "localhost")):
        """Issue (or re-issue) a certificate with common name ``name``; returns (certificate path, key path)."""
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = self._sign(_name(name), key.public_key(), self._ca_key, self._ca.subject, hosts=hosts)
        cert_path = os.path.join(self.directory, "%s.pem" % name)
        key_path = os.path.join(self.directory, "%s-key.pem" % name)
        _write(key_path, _key_pem(key), private=True)
        _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM))
        return cert_path, key_path

    def keys(self, prefix, name):
        """The config keys ``<prefix>certificate``, ``privateKey`` and ``trustRoots`` for the certificate
        ``name`` (issued now if it is not there yet)."""
        cert_path = os.path.join(self.directory, "%s.pem" % name)
        key_path = os.path.join(self.directory, "%s-key.pem" % name)
        if not (os.path.exists(cert_path) and os.path.exists(key_path)):
            cert_path, key_path = self.issue(name)
        return dict(zip((prefix + suffix for suffix in SUFFIXES), (cert_path, key_path, self.ca_path)))

    def tls(self, name):
        """The :class:`~waltz.tls.TLSConfig` of the certificate ``name`` (issued now if it is not there yet), to open
        connections with."""
        prefix = "ssl."
        return load_tls(build_config(self.keys(prefix, name), tls_keys(prefix)), prefix, CONNECTS)

    def server_keys(self, name):
        """A server's TLS keys: ``server.ssl.*`` (its client port) and ``storage.ssl.*`` (its storage
        connections), both with the certificate ``name``."""
        return dict(self.keys("server.ssl.", name), **self.keys("storage.ssl.", name))


def _general_name(host):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
