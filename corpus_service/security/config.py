"""Validation of ServiceConfig's security fields (client tokens, TLS files, rate limits), and the
warnings a server binding beyond loopback prints when it runs without them.

``cfg`` is a ``corpus_service.server.config.ServiceConfig``; that module imports this one (its
``__post_init__`` calls ``check_security``), so the type is named here, not imported."""

from __future__ import annotations

import ssl
from typing import Any

from corpus_service.security.auth import ClientToken, load_client_tokens
from ngram_common.net import is_loopback
from corpus_service.security.tls import read_pem


def check_security(cfg: Any) -> "tuple[ClientToken, ...]":
    """Raises ValueError for a bad setting; returns the parsed client tokens."""
    for name in ("admin_rate_per_s", "put_rate_per_s"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"{name}: expected a finite number >= 0 (0 = no limit), got {v!r}")
    for name in ("admin_rate_burst", "put_rate_burst"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 30:
            raise ValueError(f"{name}: expected an int in [1, {1 << 30}], got {v!r}")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("tls_cert and tls_key: expected both (TLS) or neither (plaintext)")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ValueError("tls_client_ca: mutual TLS needs --tls-cert and --tls-key too")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(cfg, name):
            read_pem(getattr(cfg, name), name)
    if cfg.tls_cert:
        try:  # a key that does not match the certificate would otherwise surface as "cannot bind"
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_cert, cfg.tls_key)
            if cfg.tls_client_ca:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cfg.tls_client_ca)
        except ssl.SSLError as e:
            raise ValueError(f"tls_cert/tls_key/tls_client_ca: not a usable certificate, key and CA: {e.reason or e}") from None
    if not cfg.client_tokens:
        return ()
    return load_client_tokens(cfg.client_tokens, [s.name for s in cfg.parsed_namespaces])


def security_warnings(cfg: Any) -> list[str]:
    """What is open on a server reachable beyond loopback. Warnings, not refusals: a corpus inside a
    private network (docker-compose, a Kubernetes NetworkPolicy) is a legitimate deployment; the
    admin token stays a hard requirement (ServiceConfig)."""
    if is_loopback(cfg.host):
        return []
    out = []
    if not cfg.client_tokens and cfg.admin_token:
        # The admin token guards the admin calls of both surfaces (security/auth.py): say so, or an
        # operator reads the warning as "anyone may reset" and loses trust in the token.
        out.append(f"SECURITY: gRPC on {cfg.host} accepts every client (no --client-tokens): anyone who can reach "
                   "the port can draft from and feed the learned corpus of every namespace; the admin calls (REST "
                   "writes, gRPC Reset, external corpora and policy versions) need the admin token")
    elif not cfg.client_tokens:  # no REST admin (--admin-port -1), so no token was required
        out.append(f"SECURITY: gRPC on {cfg.host} accepts every client (no --client-tokens, no --admin-token): "
                   "anyone who can reach the port can draft from, feed, reset and load corpora into every namespace")
    if not cfg.tls_cert:
        out.append(f"SECURITY: gRPC and the admin on {cfg.host} are plaintext (no --tls-cert/--tls-key): bearer "
                   "tokens and token ids travel unencrypted")
    return out
