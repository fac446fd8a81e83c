"""Who may call what: bearer tokens scoped to namespaces and a role, for gRPC and the REST admin.

``--client-tokens FILE`` (JSON) maps tokens to a client name, the namespaces it may use (``"*"``:
all) and a role: ``read`` (Stats, ListExternalCorpora, REST reads), ``draft`` (read + Session,
BatchGet, BatchPut, EraseMatchState: an inference replica's traffic, which feeds the learned corpus)
or ``admin`` (draft + Reset, external corpora over gRPC, uploads and deletes over REST; snapshots
need admin on ``"*"``). The ``--admin-token`` is an admin on every namespace.

Without a token file gRPC drafting and reads and REST reads stay open (the loopback default); the
mutating admin calls of both surfaces (REST writes; gRPC ``Reset`` and the external-corpus methods)
need the admin token when one is set: one authority for admin actions, whichever surface they come
through. With a token file, every call needs a known token: gRPC answers
UNAUTHENTICATED (missing or unknown token) or PERMISSION_DENIED (namespace or role); REST 401
(missing), 403 (unknown token, namespace or role). Permission is checked before existence, so a
client cannot probe which namespaces exist.

Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every entry (no early
exit), and never appear in logs, error messages or metric labels: clients are named by ``name``.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from corpus_service.names import NAME_RULE_TEXT, is_valid_name
from corpus_service.protocol.status import CorpusError

log = logging.getLogger("corpus_service.auth")
ALL = "*"
MIN_TOKEN_CHARS = 16
_HEX64 = re.compile(r"[0-9a-f]{64}")  # fullmatch


class Role(enum.IntEnum):
    READ = 1
    DRAFT = 2
    ADMIN = 3


# The least role each Corpus RPC needs (before its namespace is checked). Methods not listed, and
# other services (reflection, anything added later), need admin on every namespace: default-deny.
METHOD_ROLES = {
    "Session": Role.DRAFT, "BatchGet": Role.DRAFT, "BatchPut": Role.DRAFT, "EraseMatchState": Role.DRAFT,
    "ListExternalCorpora": Role.READ, "Stats": Role.READ,
    "LoadExternalCorpus": Role.ADMIN, "CommitExternalCorpus": Role.ADMIN, "RemoveExternalCorpus": Role.ADMIN,
    "Reset": Role.ADMIN, "AnnouncePolicyVersion": Role.ADMIN,
}
CORPUS_SERVICE = "/ngram_corpus.v1.Corpus/"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes carry no credentials


class AuthError(CorpusError):
    """A refused credential; ``http_status`` is the REST admin's answer."""

    http_status = 403

    def __init__(self, message: str, code: grpc.StatusCode, http_status: int) -> None:
        super().__init__(message, code)
        self.http_status = http_status


def unauthenticated(message: str) -> AuthError:
    return AuthError(message, grpc.StatusCode.UNAUTHENTICATED, 401)


def denied(message: str) -> AuthError:
    return AuthError(message, grpc.StatusCode.PERMISSION_DENIED, 403)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``name`` is safe to log; the token is not kept."""

    name: str
    role: Role
    namespaces: frozenset[str]

    def may(self, role: Role, namespace: str) -> bool:
        return self.role >= role and (namespace in self.namespaces or ALL in self.namespaces)

    def may_all(self, role: Role) -> bool:
        return self.role >= role and ALL in self.namespaces

    def require(self, role: Role, namespace: str) -> None:
        if not self.may(role, namespace):
            raise denied(f"client '{self.name}' (role {self.role.name.lower()}) may not use namespace "
                         f"{namespace!r:.80} as {role.name.lower()}")

    def require_all(self, role: Role) -> None:
        if not self.may_all(role):
            raise denied(f"client '{self.name}' needs the {role.name.lower()} role on every namespace ('*')")


@dataclass(frozen=True, slots=True)
class ClientToken:
    principal: Principal
    digest: bytes  # SHA-256 of the token


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_client_tokens(data: object, known_namespaces: Iterable[str] = ()) -> tuple[ClientToken, ...]:
    """``{"clients": [{"name", "token" | "token_sha256", "namespaces": [...], "role"}]}`` -> entries.
    Error messages name the entry, never its token."""
    if not isinstance(data, dict) or set(data) != {"clients"} or not isinstance(data["clients"], list):
        raise ValueError('client_tokens: expected a JSON object {"clients": [...]}')
    known = set(known_namespaces)
    out: list[ClientToken] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, entry in enumerate(data["clients"]):
        where = f"client_tokens: clients[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object")
        extra = set(entry) - {"name", "token", "token_sha256", "namespaces", "role"}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)}")
        name = entry.get("name")
        if not is_valid_name(name):
            raise ValueError(f"{where}: name: expected {NAME_RULE_TEXT}, got {name!r:.80}")
        where = f"client_tokens: client '{name}'"
        if name in names:
            raise ValueError(f"{where}: duplicate name")
        token, hexdigest = entry.get("token"), entry.get("token_sha256")
        if (token is None) == (hexdigest is None):
            raise ValueError(f"{where}: expected exactly one of 'token' and 'token_sha256'")
        if token is not None:
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or token != token.strip():
                raise ValueError(f"{where}: token: expected a string of at least {MIN_TOKEN_CHARS} characters "
                                 "without surrounding spaces")
            d = digest(token)
        else:
            if not isinstance(hexdigest, str) or not _HEX64.fullmatch(hexdigest):
                raise ValueError(f"{where}: token_sha256: expected 64 lowercase hex digits")
            d = bytes.fromhex(hexdigest)
        if d in digests:
            raise ValueError(f"{where}: the same token is given to another client")
        role = entry.get("role", "draft")
        if role not in ("read", "draft", "admin"):
            raise ValueError(f"{where}: role: expected read, draft or admin, got {role!r:.40}")
        namespaces = entry.get("namespaces")
        if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) for n in namespaces):
            raise ValueError(f"{where}: namespaces: expected a non-empty list of names (or [\"*\"])")
        unknown = [n for n in namespaces if n != ALL and known and n not in known]
        if unknown:
            raise ValueError(f"{where}: namespaces: unknown {unknown} (served: {sorted(known)})")
        names.add(name)
        digests.add(d)
        out.append(ClientToken(Principal(name, Role[role.upper()], frozenset(namespaces)), d))
    return tuple(out)


def load_client_tokens(path: str, known_namespaces: Iterable[str] = ()) -> tuple[ClientToken, ...]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"client_tokens: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"client_tokens: {path} is not JSON (line {e.lineno})") from None  # no excerpt: it may hold a token
    return parse_client_tokens(data, known_namespaces)


ADMIN_NAME = "admin-token"


class Authenticator:
    """Token -> Principal. ``required``: a token file is configured (every call needs a token)."""

    def __init__(self, clients: tuple[ClientToken, ...] = (), admin_token: str | None = None) -> None:
        entries = list(clients)
        if admin_token:
            entries.append(ClientToken(Principal(ADMIN_NAME, Role.ADMIN, frozenset({ALL})), digest(admin_token)))
        self._entries = tuple(entries)
        self.required = bool(clients)
        self.has_admin_token = bool(admin_token)

    def identify(self, token: str | None) -> Principal | None:
        """The principal holding ``token``, or None. Every entry is compared (constant time in the
        position of the match and in the token's content)."""
        if not token:
            return None
        d = digest(token)
        found = None
        for entry in self._entries:
            if hmac.compare_digest(d, entry.digest):
                found = entry.principal
        return found

    def authenticate(self, authorization: str | None) -> Principal:
        """An ``Authorization`` value (``Bearer <token>``) -> the principal, or AuthError."""
        token = bearer_token(authorization)
        if token is None:
            raise unauthenticated("missing bearer token (send 'authorization: Bearer <token>')")
        principal = self.identify(token)
        if principal is None:
            raise denied_unknown()
        return principal


def denied_unknown() -> AuthError:
    # gRPC: UNAUTHENTICATED (no valid credential); REST keeps its documented 403 for a wrong token.
    return AuthError("unknown bearer token", grpc.StatusCode.UNAUTHENTICATED, 403)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# ---------------------------------------------------------------------- gRPC

_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("corpus_caller", default=None)


def current_principal() -> Principal | None:
    """The caller of the RPC being served (set by ``AuthInterceptor``); None when auth is off."""
    return _CALLER.get()


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


def _rejecting(handler: grpc.RpcMethodHandler, error: AuthError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers ``error`` without running anything."""
    async def unary_response(request, context):
        await context.abort(error.code, str(error))

    async def stream_response(request, context):
        await context.abort(error.code, str(error))
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        make, behavior = grpc.stream_stream_rpc_method_handler, stream_response
    elif handler.request_streaming:
        make, behavior = grpc.stream_unary_rpc_method_handler, unary_response
    elif handler.response_streaming:
        make, behavior = grpc.unary_stream_rpc_method_handler, stream_response
    else:
        make, behavior = grpc.unary_unary_rpc_method_handler, unary_response
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call (health checks excepted) and checks the method's least role; the
    servicer checks each request's namespace against ``current_principal()``. With only an admin
    token (no client tokens), only the admin methods need a token (the admin token)."""

    def __init__(self, auth: Authenticator, on_denied=None) -> None:
        self.auth = auth
        self._on_denied = on_denied  # (code name) -> None, for metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        if not self.auth.required:  # admin token only: drafting, reads and other services stay open
            role = METHOD_ROLES.get(method[len(CORPUS_SERVICE):]) if method.startswith(CORPUS_SERVICE) else None
            if role != Role.ADMIN:
                return await continuation(details)
        try:
            principal = self.auth.authenticate(_metadata_value(details.invocation_metadata, "authorization"))
            role = METHOD_ROLES.get(method[len(CORPUS_SERVICE):]) if method.startswith(CORPUS_SERVICE) else None
            if role is None:
                principal.require_all(Role.ADMIN)
            elif principal.role < role:
                raise denied(f"client '{principal.name}' (role {principal.role.name.lower()}) may not call "
                             f"{method.rsplit('/', 1)[-1]}: it needs the {role.name.lower()} role")
        except AuthError as e:
            log.debug("refused %s: %s", method, e)
            if self._on_denied is not None:
                self._on_denied(e.code.name)
            handler = await continuation(details)
            return None if handler is None else _rejecting(handler, e)
        _CALLER.set(principal)
        return await continuation(details)


__all__ = ["ALL", "AuthError", "AuthInterceptor", "Authenticator", "ClientToken", "Principal", "Role",
           "current_principal", "load_client_tokens", "parse_client_tokens"]
