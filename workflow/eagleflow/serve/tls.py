"""TLS for an engine server on TCP (`draft.stream_tls`, docs/streaming.md#transport): a
self-signed certificate made for the run by the job that starts the server, written beside
its key in the private `.engine/` folder (`<key>.cert.pem`, and `<key>.tls.pem`, mode 0600),
and pinned by every client: a client trusts that certificate and no other, so no host name or
certificate authority is involved. The HMAC handshake (`eagleflow.serve.wire`) still runs
inside TLS; TLS adds what it lacks: the token ids and states are encrypted, and a relayed or
hijacked connection cannot inject or alter a message.
"""

from __future__ import annotations

import datetime
import ssl
import subprocess
import tempfile
from pathlib import Path

from eagleflow.store.private import read_private, write_private

DAYS = 30  # a run's server lives hours; its certificate is made again at each start


def make_certificate(cert: Path, key: Path, name: str) -> None:
    """A fresh P-256 key and self-signed certificate for `name`: with `cryptography` when it
    is installed, else with the `openssl` command."""
    try:
        cert_pem, key_pem = _with_cryptography(name)
    except ImportError:
        cert_pem, key_pem = _with_openssl(name)
    write_private(key, key_pem, mode=0o600)
    write_private(cert, cert_pem, mode=0o644)


def _with_cryptography(name: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


def _with_openssl(name: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as d:
        cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                str(DAYS),
                "-subj",
                f"/CN={name}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return cert.read_text(), key.read_text()


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server's side: its certificate and key, both from the private folder."""
    read_private(key, secret=True)
    read_private(cert)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    return ctx


def client_context(cert: Path) -> ssl.SSLContext:
    """A client's side: the run's certificate and no other (pinned; no host name check)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=read_private(cert))
    return ctx
