"""Certificates made for the tests (the ``cryptography`` package): a CA, and
server and client certificates it signs, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class CertificateAuthority:
    """A self-signed CA in ``directory`` (``ca.pem``) that issues certificates."""

    def __init__(self, directory: Path, name: str = "pagedkv test CA") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
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
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / "ca.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, name: str, *, server: bool, dns_names: tuple[str, ...] = ("localhost",)
    ) -> Pair:
        """A certificate for ``name`` (a server's also names ``dns_names``,
        and 127.0.0.1 when they include localhost), written as ``{name}.pem``
        and ``{name}-key.pem``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
            if "localhost" in dns_names:
                names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pair = Pair(self.directory / f"{name}.pem", self.directory / f"{name}-key.pem")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_key_pem(key))
        pair.key.chmod(0o600)
        return pair
