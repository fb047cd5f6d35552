"""Mutual TLS (`deliver.push.tls`): a subscription presents its project's client certificate to an
endpoint that requires one from a test CA; without it the endpoint refuses the handshake; a
rotated certificate is presented without a restart; a secret that is not a certificate and its key
is refused naming the secret, never its content."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.builders import make_sub
from tests.support.helpers import eventually
from tests.support.pulsar_client import Client
from worker.endpoint.client_tls import ClientCertificates
from worker.endpoint.destinations import DestinationPolicy
from worker.endpoint.secrets import SecretRef, SecretStore, SecretUnavailable
from worker.model.subscriptions import ClientTls

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def issued(where: Path, name: str, ca: tuple[Path, Path], san: str | None = None) -> tuple[Path, Path]:
    """A certificate for CN=`name` signed by `ca`, and its key."""
    cert, key, csr = where / f"{name}.pem", where / f"{name}.key", where / f"{name}.csr"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    extra = []
    if san:
        (where / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", str(where / f"{name}.ext")]
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
            "-days", "1", "-out", str(cert), *extra)
    return cert, key


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    ca = (tmp_path / "ca.pem", tmp_path / "ca.key")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", str(ca[1]), "-out", str(ca[0]))
    return {"ca": ca, "server": issued(tmp_path, "endpoint", ca, "IP:127.0.0.1"),
            "client-1": issued(tmp_path, "client-1", ca), "client-2": issued(tmp_path, "client-2", ca)}


async def test_the_client_certificate_is_presented_refused_without_it_and_rotated_without_a_restart(
        start_worker, client: Client, topic, tmp_path, pki, monkeypatch):
    seen: list[tuple[str, str]] = []  # (path, the client certificate's CN)

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(pair for rdn in (peer or {}).get("subject", ()) for pair in rdn)
        seen.append((request.path, subject.get("commonName", "")))
        return web.Response(status=204)

    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(*pki["server"])
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(pki["ca"][0])
    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    secrets = tmp_path / "secrets"
    (secrets / "p-test").mkdir(parents=True)
    for src, name in ((pki["client-1"][0], "client-cert"), (pki["client-1"][1], "client-key")):
        shutil.copy(src, secrets / "p-test" / name)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"][0]))  # the endpoint's private CA, as the docs say
    tls = ClientTls(SecretRef(secret="client-cert", project="p-test"), SecretRef(secret="client-key", project="p-test"))
    with_cert = make_sub(topic, f"https://127.0.0.1:{port}/with", tls=tls)
    without = make_sub(topic + "-n", f"https://127.0.0.1:{port}/without", max_deliver=1)
    try:
        w = await start_worker(with_cert, without, secrets_dir=secrets,
                               destinations=DestinationPolicy(allow_private=True))
        client.publish(with_cert.topic, [b"a%d" % i for i in range(5)])
        client.publish(without.topic, [b"n"])
        await eventually(lambda: len(seen) >= 5, what="delivered with the certificate")
        assert set(seen) == {("/with", "client-1")}

        def refused() -> bool:
            return bool(w.metrics.registry.get_sample_value("pushworker_deliveries_total", {
                "project": "p-test", "subscription": without.name, "result": "connection_error"}))

        await eventually(refused, what="the handshake without a certificate refused")
        assert all(path == "/with" for path, _ in seen)

        for src, name in ((pki["client-2"][0], "client-cert"), (pki["client-2"][1], "client-key")):
            shutil.copy(src, secrets / "p-test" / name)  # rotated: secrets are re-read within 10 s

        def rotated() -> bool:
            client.publish(with_cert.topic, [b"after"])
            return ("/with", "client-2") in seen

        await eventually(rotated, timeout=30, interval=1.0, what="the rotated certificate presented")
    finally:
        await runner.cleanup()


@pytest.mark.broker_independent
def test_a_secret_that_is_not_a_certificate_and_its_key_is_refused_naming_it_never_its_content(tmp_path, pki):
    (tmp_path / "p-a").mkdir()
    shutil.copy(pki["client-1"][0], tmp_path / "p-a" / "cert")
    shutil.copy(pki["client-2"][1], tmp_path / "p-a" / "other-key")  # a key, but not the certificate's
    (tmp_path / "p-a" / "garbage").write_text("hunter2-not-a-pem")
    certificates = ClientCertificates(SecretStore(secrets_dir=tmp_path))
    for cert, key in (("garbage", "other-key"), ("cert", "other-key"), ("cert", "garbage")):
        with pytest.raises(SecretUnavailable) as refused:
            certificates.context(SecretRef(secret=cert, project="p-a"), SecretRef(secret=key, project="p-a"))
        assert f"secret {cert} of project p-a" in str(refused.value) and "hunter2" not in str(refused.value)
    shutil.copy(pki["client-1"][1], tmp_path / "p-a" / "key")
    good = certificates.context(SecretRef(secret="cert", project="p-a"), SecretRef(secret="key", project="p-a"))
    assert good is certificates.context(SecretRef(secret="cert", project="p-a"), SecretRef(secret="key", project="p-a"))
