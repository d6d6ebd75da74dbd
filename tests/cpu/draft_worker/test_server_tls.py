"""TLS between target and draft worker: server-only and mutual, with certificates made here.

A throwaway CA signs a server certificate for 127.0.0.1 and a client certificate; a target
with the CA and its own pair connects, one without a client certificate (when the server
requires one) or without the CA does not.
"""

from __future__ import annotations

import datetime
import ipaddress

import pytest

pytest.importorskip("cryptography", reason="the `cryptography` package is needed to make test certificates")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from outrider.draft_worker import build_proposer  # noqa: E402
from outrider.draft_worker.server import DraftIdentity, ServerTls, serve  # noqa: E402
from outrider.proto import HandshakeRequest, Limits  # noqa: E402
from outrider.target_worker.draft_client import ClientTls, DraftClientConfig, RemoteDraftSource  # noqa: E402

VOCAB = 50
HANDSHAKE = HandshakeRequest("target", VOCAB, "fp", 4, 64, Limits(64, 16, 8, 4))


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(name: str, key, issuer_name: str, issuer_key, *, ca: bool = False, ip: str | None = None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), False
        )
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki() -> dict[str, bytes]:
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    return {
        "ca": _certificate("outrider-test-ca", ca_key, "outrider-test-ca", ca_key, ca=True),
        "server_cert": _certificate("draft-worker", server_key, "outrider-test-ca", ca_key, ip="127.0.0.1"),
        "server_key": _pem(server_key),
        "client_cert": _certificate("target-worker", client_key, "outrider-test-ca", ca_key),
        "client_key": _pem(client_key),
    }


def _proposer():
    return build_proposer({"method": "ngram", "num_speculative_tokens": 4}, vocab_size=VOCAB)


def _connects(port: int, tls: ClientTls | None) -> bool:
    config = DraftClientConfig(tls=tls, connect_timeout_s=1.0, backoff_initial_s=0.05)
    source = RemoteDraftSource([f"127.0.0.1:{port}"], HANDSHAKE, config)
    try:
        return source.wait_ready(0.7)
    finally:
        source.close()


@pytest.mark.parametrize("mutual", [False, True])
def test_tls(pki, mutual):
    tls = ServerTls(pki["server_cert"], pki["server_key"], pki["ca"] if mutual else None)
    server = serve(_proposer(), DraftIdentity("ngram", VOCAB, "fp"), address="127.0.0.1:0", tls=tls)
    try:
        full = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
        assert _connects(server.port, full)
        assert _connects(server.port, ClientTls(pki["ca"])) is not mutual  # no client certificate
        assert not _connects(server.port, None)  # plaintext to a TLS port
        assert not _connects(server.port, ClientTls(pki["client_cert"]))  # a CA that did not sign it
    finally:
        server.stop(1)


def test_the_draft_pool_config_secures_both_sides_from_files(pki, tmp_path):
    """`draft_pool` token and TLS files (mounted Secrets under Kubernetes) give the draft
    deployment's servers and the targets' clients matching settings: mutual TLS + token."""
    from outrider.cluster.config import DraftPoolArgs

    files = {"ca": pki["ca"], "cert": pki["server_cert"], "key": pki["server_key"], "token": b"s3cret\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    pool = DraftPoolArgs(
        mode="deployment",
        token_file=str(tmp_path / "token"),
        tls_cert_file=str(tmp_path / "cert"),
        tls_key_file=str(tmp_path / "key"),
        tls_ca_file=str(tmp_path / "ca"),
    )
    server_tls, token = pool.server_security()
    assert token == "s3cret" and server_tls.client_ca == pki["ca"]
    server = serve(
        _proposer(), DraftIdentity("ngram", VOCAB, "fp"), address="127.0.0.1:0", tls=server_tls, token=token
    )
    try:
        client_tls, client_token = pool.client_security()
        config = DraftClientConfig(tls=client_tls, token=client_token, connect_timeout_s=1.0)
        source = RemoteDraftSource([f"127.0.0.1:{server.port}"], HANDSHAKE, config)
        try:
            assert source.wait_ready(5)
        finally:
            source.close()
        wrong = DraftClientConfig(
            tls=client_tls, token="guess", connect_timeout_s=1.0, backoff_initial_s=0.05
        )
        source = RemoteDraftSource([f"127.0.0.1:{server.port}"], HANDSHAKE, wrong)
        try:
            assert not source.wait_ready(1.5)
        finally:
            source.close()
    finally:
        server.stop(1)
    with pytest.raises(ValueError, match="go together"):
        DraftPoolArgs(mode="deployment", tls_cert_file=str(tmp_path / "cert"))
