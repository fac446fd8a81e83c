"""TLS for gRPC and the REST admin: server credentials from PEM files, client channels.

Server: ``--tls-cert``/``--tls-key`` switch both gRPC and the admin to TLS (HTTPS); ``--tls-client-ca``
also requires clients to present a certificate signed by that CA (mutual TLS) on both.
Clients: ``ClientTLS`` (CA bundle, optional client certificate) or, by default, the environment:
``NGRAM_CORPUS_TLS_CA``, ``NGRAM_CORPUS_TLS_CLIENT_CERT``, ``NGRAM_CORPUS_TLS_CLIENT_KEY``.
Bearer tokens go in per-call metadata (``authorization``), which also works on loopback plaintext.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from ngram_common.net import is_loopback

log = logging.getLogger("corpus_service.tls")
TOKEN_ENV = "NGRAM_CORPUS_TOKEN"
CA_ENV = "NGRAM_CORPUS_TLS_CA"
CERT_ENV = "NGRAM_CORPUS_TLS_CLIENT_CERT"
KEY_ENV = "NGRAM_CORPUS_TLS_CLIENT_KEY"


def read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    pair = (read_pem(key, "tls_key"), read_pem(cert, "tls_cert"))
    ca = read_pem(client_ca, "tls_client_ca") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True, slots=True)
class ClientTLS:
    ca: str | None = None  # PEM roots to trust; None = the system's roots
    cert: str | None = None  # client certificate (mutual TLS), with ``key``
    key: str | None = None
    server_name: str | None = None  # the name to verify instead of the target's host

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("ClientTLS: cert and key go together (mutual TLS)")

    @classmethod
    def from_env(cls) -> "ClientTLS | None":
        ca, cert, key = (os.environ.get(v) or None for v in (CA_ENV, CERT_ENV, KEY_ENV))
        return cls(ca, cert, key) if ca or cert else None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "tls ca") if self.ca else None,
            private_key=read_pem(self.key, "tls client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "tls client cert") if self.cert else None)


def resolve_tls(tls: "ClientTLS | str | bool | None") -> ClientTLS | None:
    """A client's ``tls`` argument: a ClientTLS, a CA file path, True (system roots), False
    (plaintext), or None (the environment; plaintext when it names nothing)."""
    if tls is None:
        return ClientTLS.from_env()
    if tls is False:
        return None
    if tls is True:
        return ClientTLS()
    if isinstance(tls, str):
        return ClientTLS(ca=tls)
    if isinstance(tls, ClientTLS):
        return tls
    raise TypeError(f"tls: expected ClientTLS, a CA file path, a bool or None, got {type(tls).__name__}")


def resolve_token(token: str | None) -> str | None:
    """None: ``NGRAM_CORPUS_TOKEN`` (unset: no token); "": no token, whatever the environment says."""
    if token is None:
        return os.environ.get(TOKEN_ENV) or None
    return token or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    if token is None:
        return ()
    if not isinstance(token, str) or not token.strip() or token != token.strip() or "\n" in token:
        raise ValueError("token: expected a non-empty single-line string without surrounding spaces")
    return (("authorization", f"Bearer {token}"),)


def _all_loopback(target: str) -> bool:
    """``host:port``, ``ipv4:a:p,b:p``, ``ipv6:[::1]:p`` or ``dns:///name:port``: every address loopback?"""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix):]
    hosts = [p.strip().rsplit(":", 1)[0].strip("[]") for p in target.split(",") if p.strip()]
    return bool(hosts) and all(is_loopback(h) for h in hosts)


def open_channel(target: str, tls: ClientTLS | None, options, *, aio: bool, token: str | None = None):
    """A gRPC channel to ``target`` (plaintext without ``tls``)."""
    if token and tls is None and not _all_loopback(target):
        log.warning("sending a bearer token to %s without TLS: anyone on the path can read it", target)
    opts = list(options)
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    mod = grpc.aio if aio else grpc
    if tls is None:
        return mod.insecure_channel(target, options=opts)
    return mod.secure_channel(target, tls.channel_credentials(), options=opts)


__all__ = ["ClientTLS", "auth_metadata", "open_channel", "resolve_tls", "resolve_token", "server_credentials"]
