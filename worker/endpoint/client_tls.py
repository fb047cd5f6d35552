"""Client certificates for endpoints that require mutual TLS (`deliver.push.tls`): the TLS context a
subscription's requests present its certificate with, built from its project's secrets.

Python's ssl module loads a certificate and key only from files, and a secret is never written to
disk: they are handed over through anonymous in-memory files (memfd). Contexts are kept by their
content, so every request with the same certificate shares one context (and the connections opened
with it), and a rotated secret (re-read within 10 s, as every secret is) makes a new one without a
restart."""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Callable

from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable

MAX_CONTEXTS = 1000  # distinct certificates held at once (a rotation leaves the old one until this many)


def _in_memory(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data` (its fd; /proc/self/fd/<fd> opens it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class ClientCertificates:
    """The TLS context presenting a subscription's client certificate, built once per certificate."""

    def __init__(self, secrets: SecretStore, base: Callable[[], ssl.SSLContext] = ssl.create_default_context) -> None:
        self.secrets = secrets
        self.base = base  # trust and verification as for every request (SSL_CERT_FILE names a private CA)
        self._contexts: dict[bytes, ssl.SSLContext] = {}

    def context(self, certificate: SecretRef, key: SecretRef) -> ssl.SSLContext:
        """Raises SecretUnavailable (naming the secret, never its content) when either cannot be
        read or they do not make a certificate and its key."""
        cert_pem, key_pem = self.secrets.read(certificate), self.secrets.read(key)
        digest = hashlib.sha256(len(cert_pem).to_bytes(8, "big") + cert_pem + key_pem).digest()
        known = self._contexts.get(digest)
        if known is not None:
            return known
        context = self.base()
        fds: list[int] = []
        try:
            fds = [_in_memory("client-certificate", cert_pem), _in_memory("client-key", key_pem)]
            context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}", password=_no_password)
        except (ssl.SSLError, ValueError, TypeError) as e:
            raise SecretUnavailable(f"{certificate.describe()} and {key.describe()} are not a PEM certificate "
                                    f"and its unencrypted private key ({type(e).__name__})") from None
        finally:
            for fd in fds:
                os.close(fd)
        if len(self._contexts) >= MAX_CONTEXTS:
            self._contexts.clear()
        self._contexts[digest] = context
        return context


def _no_password() -> bytes:
    # An encrypted key would make OpenSSL ask for a passphrase on the terminal: it is refused instead.
    raise ValueError("the private key is encrypted")
