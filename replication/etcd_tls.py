"""etcd over mutual TLS: the certificates in a keys directory's `etcd/` folder, how they are made, and what a client
and a member do with them.

`elasticctl keys generate DIR` writes, beside the CURVE keys, `DIR/etcd/`: a
private certificate authority (`ca.crt`; its key `ca.key` is kept there, 0600,
to issue more), one certificate for the members (`server.crt`, valid for the
hosts given: the members' names and addresses) and one for their clients
(`client.crt`). Secret keys are 0600 from creation. They are made with the
`cryptography` library: the standard library verifies certificates but cannot
issue them, and calling an `openssl` binary would depend on its version and
configuration.

A member (`member_flags`) serves clients and peers over TLS only and requires
a certificate from the CA of each (`--client-cert-auth`,
`--peer-client-cert-auth`): whoever reaches its ports without one gets no
answer, and cannot read, write, or hold a leader key. The members' certificate
serves both ends (etcd's JSON gateway dials its own gRPC server with it). A
client (`client_context`) trusts only the CA and presents the client
certificate; the CA is the deployment's own, so any certificate it signed is
one we issued, and a member is not also checked by name.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ETCD_DIR = "etcd"
VALID_DAYS = 3650
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class EtcdTls:
    """The certificates of one control plane's etcd, in `directory`."""

    directory: Path

    @classmethod
    def of_keys(cls, keys_dir: Path | None) -> EtcdTls | None:
        """The etcd certificates of a keys directory, or None when it has none."""
        if keys_dir is None or not (keys_dir / ETCD_DIR / "ca.crt").is_file():
            return None
        return cls(keys_dir / ETCD_DIR)

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def client_context(self, certificate: str = "client") -> ssl.SSLContext:
        """What our etcd client speaks: TLS to a member the CA signed, with the client certificate (`certificate`
        "server": a member's own, which also serves as a client's, for a member that has no other). ssl.SSLError or
        OSError when a file is missing or unusable."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.path("ca.crt"))
        context.check_hostname = False  # the CA is the deployment's own: it signed nothing but our members
        context.load_cert_chain(self.path(f"{certificate}.crt"), self.path(f"{certificate}.key"))
        return context

    def member_flags(self) -> list[str]:
        """A member's flags: TLS for clients and peers, each required to show a certificate the CA signed."""
        server, key, ca = self.path("server.crt"), self.path("server.key"), self.path("ca.crt")
        return [
            f"--cert-file={server}",
            f"--key-file={key}",
            "--client-cert-auth",
            f"--trusted-ca-file={ca}",
            f"--peer-cert-file={server}",
            f"--peer-key-file={key}",
            "--peer-client-cert-auth",
            f"--peer-trusted-ca-file={ca}",
        ]


def make_etcd_certs(keys_dir: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> EtcdTls:
    """A new CA and the members' and clients' certificates in `keys_dir/etcd/`; the members' is valid for `hosts`
    (names or IP addresses). Replaces what was there."""
    directory = keys_dir / ETCD_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic control plane etcd CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(directory / "ca.key", _private_bytes(ca_key), secret=True)
    _write(directory / "ca.crt", ca.public_bytes(serialization.Encoding.PEM), secret=False)
    usages = {
        "server": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        "client": [ExtendedKeyUsageOID.CLIENT_AUTH],
    }
    for name, usage in usages.items():
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"elastic etcd {name}")])
        builder = _builder(subject, ca_name, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usage), critical=False
        )
        if name == "server":
            builder = builder.add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        certificate = builder.sign(ca_key, hashes.SHA256())
        _write(directory / f"{name}.key", _private_bytes(key), secret=True)
        _write(directory / f"{name}.crt", certificate.public_bytes(serialization.Encoding.PEM), secret=False)
    return EtcdTls(directory)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, secret: bool) -> None:
    """Write `path` anew; a secret one is 0600 from its creation."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if secret else 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
