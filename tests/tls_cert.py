"""Test TLS material: a self-signed certificate for 127.0.0.1."""

from __future__ import annotations

import datetime
from pathlib import Path


def self_signed(tmp: Path, mismatched_key: bool = False) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (cryptography), as PEM files (key, cert);
    `mismatched_key`: the key file holds another key than the one the certificate is for."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    if mismatched_key:
        key = ec.generate_private_key(ec.SECP256R1())
    k, c = tmp / "key.pem", tmp / "cert.pem"
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))  # fmt: skip
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(k), str(c)
