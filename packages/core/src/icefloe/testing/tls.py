"""A self-signed certificate for tests that run a server with TLS (Redis, PostgreSQL): made
with the ``openssl`` command line, which every server package here depends on anyway."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    """A certificate for ``127.0.0.1`` and ``localhost`` that is its own CA, and its key."""

    cert: Path
    key: Path

    @property
    def ca(self) -> Path:
        """What a client trusts: the certificate itself (self-signed)."""
        return self.cert


def self_signed_cert(directory: Path, days: int = 2) -> TlsFiles:
    """Write ``server.crt`` and ``server.key`` (mode 0600, as PostgreSQL demands) into
    ``directory``; the certificate names 127.0.0.1 and localhost, so clients can verify the
    host as well as the chain."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError(
            "the openssl command is needed for TLS tests (apt-get install openssl)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "server.crt", directory / "server.key")
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            str(days),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(files.key),
            "-out",
            str(files.cert),
        ],
        check=True,
        capture_output=True,
    )
    files.key.chmod(0o600)
    return files
