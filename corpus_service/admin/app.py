"""The REST admin (FastAPI): upload, list, get and delete external corpora; jobs; stats; snapshots;
/metrics, /healthz, /readyz. Routes stay thin: the catalog owns the logic, schemas the bodies.

No ``from __future__ import annotations`` here: FastAPI resolves route signatures at run time and
the dependency aliases are local to ``create_admin_app``."""


import asyncio
import json
import logging
import time
import uuid
from typing import Annotated

import grpc
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from corpus_service.admin.catalog import Catalog, CorpusConflict
from corpus_service.admin.schemas import (CorpusOut, ErrorResponse, IntegrityOut, JobOut, NamespaceOut, PolicyVersionIn,
                                          PolicyVersionOut, SnapshotOut, StatusOut)
from corpus_service.admin.uploads import FORMATS, UploadError
from corpus_service.exceptions import StalePolicyVersionError
from corpus_service.names import check_corpus_name
from corpus_service.protocol.status import CorpusError
from corpus_service.security.auth import AuthError, Principal, Role
from corpus_service.security.rate_limit import RateLimited
from corpus_service.server.policy_versions import announce
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.admin")
_ERRORS = {c: {"model": ErrorResponse} for c in (400, 401, 403, 404, 409, 413, 429, 503)}


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def json_body(request: Request, schema):
    """The request's body as ``schema``, read as JSON whatever its Content-Type; 422 naming the field
    (or saying JSON is expected) otherwise."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        kind = request.headers.get("content-type", "none")
        raise HTTPException(422, f"body: expected a JSON object such as {{\"version\": 3}} (got {len(raw)} bytes that "
                                 f"are not JSON: {str(e)[:120]}; Content-Type {kind})") from None
    if not isinstance(obj, dict):
        raise HTTPException(422, f"body: expected a JSON object, got {type(obj).__name__}")
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid value")
        raise HTTPException(422, f"{where}: {msg}") from None


def create_admin_app(state: ServiceState, catalog: Catalog) -> FastAPI:
    app = FastAPI(title="ngram-corpus admin", version="1", responses=_ERRORS,
                  description="External corpora, jobs, stats and snapshots of the shared n-gram draft corpus.")
    auth = state.auth
    # Without tokens at all (loopback only: ServiceConfig refuses otherwise) every route is open;
    # with only the admin token, reads stay open; with client tokens, every /v1 route needs one.
    writes_need_token = auth.required or auth.has_admin_token

    def authenticate(authorization: str | None) -> Principal:
        try:
            return auth.authenticate(authorization)
        except AuthError as e:
            state.metrics.auth_refused.labels("rest", str(e.http_status)).inc()
            raise HTTPException(e.http_status, str(e),
                                headers={"WWW-Authenticate": "Bearer"} if e.http_status == 401 else None) from None

    def require(principal: Principal | None, role: Role, namespace: str | None = None) -> None:
        if principal is None:
            return
        try:
            principal.require(role, namespace) if namespace is not None else principal.require_all(role)
        except AuthError as e:
            state.metrics.auth_refused.labels("rest", "403").inc()
            raise HTTPException(403, str(e)) from None

    def read_caller(authorization: Annotated[str | None, Header()] = None) -> Principal | None:
        return authenticate(authorization) if auth.required else None

    def write_caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Principal | None:
        if state.draining:
            raise HTTPException(503, "the corpus server is draining (shutting down)")
        principal = authenticate(authorization) if writes_need_token else None
        try:
            state.admin_limit.acquire(principal.name if principal is not None else
                                      (request.client.host if request.client else "unknown"))
        except RateLimited as e:
            state.metrics.rate_limited.labels("rest", state.admin_limit.what).inc()
            raise HTTPException(429, str(e), headers={"Retry-After": e.retry_after_header()}) from None
        return principal

    Reader = Annotated[Principal | None, Depends(read_caller)]
    Writer = Annotated[Principal | None, Depends(write_caller)]

    def require_token(principal: Writer) -> None:
        require(principal, Role.ADMIN)  # routes over every namespace: admin on '*'

    Auth = Annotated[None, Depends(require_token)]

    def require_read_all(principal: Reader) -> None:
        require(principal, Role.READ)  # a route over every namespace (e.g. /v1/replication)

    app.state.require_read_all = require_read_all  # for routers mounted by the service

    def namespace_dep(namespace: Annotated[str, Path(max_length=64)], principal: Reader) -> str:
        require(principal, Role.READ, namespace)  # before existence: no probing for other namespaces
        state.corpus(namespace)  # KeyError -> 404
        return namespace

    def admin_namespace_dep(namespace: Annotated[str, Path(max_length=64)], principal: Writer) -> str:
        require(principal, Role.ADMIN, namespace)
        state.corpus(namespace)
        return namespace

    def name_dep(name: Annotated[str, Path(max_length=64)]) -> str:
        return check_corpus_name(name)

    Namespace = Annotated[str, Depends(namespace_dep)]
    AdminNamespace = Annotated[str, Depends(admin_namespace_dep)]
    Name = Annotated[str, Depends(name_dep)]

    # ------------------------------------------------------------------ errors: always JSON

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException and unmatched routes
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                422: "invalid_request", 429: "rate_limited", 503: "unavailable"}.get(exc.status_code, "error")
        return _error(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return _error(422, "invalid_request", "; ".join(parts))

    @app.exception_handler(KeyError)
    async def not_found(request: Request, exc: KeyError):
        return _error(404, "not_found", str(exc.args[0]) if exc.args else "not found")

    @app.exception_handler(CorpusConflict)
    async def conflict(request: Request, exc: CorpusConflict):
        return _error(409, "conflict", str(exc))

    @app.exception_handler(StalePolicyVersionError)
    async def stale_version(request: Request, exc: StalePolicyVersionError):
        return _error(409, "conflict", str(exc))

    @app.exception_handler(CorpusError)  # e.g. a replica whose commit log is down (announce)
    async def corpus_error(request: Request, exc: CorpusError):
        if exc.code == grpc.StatusCode.UNAVAILABLE:
            return _error(503, "unavailable", str(exc))
        return _error(400, "invalid_argument", str(exc))

    @app.exception_handler(UploadError)
    async def bad_upload(request: Request, exc: UploadError):
        return _error(exc.status, "too_large" if exc.status == 413 else "bad_upload", str(exc))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect):
        return _error(400, "client_disconnected", "the client disconnected before the upload completed")

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError):
        return _error(400, "invalid_argument", str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        # The exception's text may name server paths (OSError): the log keeps it, the client gets
        # an id to quote.
        ref = uuid.uuid4().hex[:12]
        log.exception("%s %s failed (error id %s)", request.method, request.url.path, ref)
        return _error(500, "internal", f"internal error ({type(exc).__name__}, error id {ref}; see the server log)")

    @app.middleware("http")
    async def record(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        state.metrics.http_total.labels(request.method, route, str(response.status_code)).inc()
        state.metrics.http_latency.labels(route).observe(time.perf_counter() - t0)
        return response

    # ------------------------------------------------------------------ probes, metrics

    @app.get("/healthz", response_model=StatusOut)
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", response_model=StatusOut)
    async def readyz():
        if state.draining:
            return _error(503, "unavailable", "draining")
        if not state.ready:
            return _error(503, "unavailable", state.not_ready_reason or "restoring snapshots")
        return {"status": "ready"}

    @app.get("/metrics", response_class=Response)
    async def metrics(principal: Reader):
        # With --client-tokens, /metrics needs read on every namespace ('*'): its series name every
        # namespace (token and byte counts), which a client scoped to one must not enumerate.
        require(principal, Role.READ)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ namespaces, stats

    def namespace_out(ns: str) -> dict:
        corpus = state.corpus(ns)
        spec = state.specs[ns]
        return {"name": ns, "vocab_size": corpus.config.vocab_size,
                "tokenizer": state.tokenizers.name(ns) if spec.tokenizer else None, "stats": corpus.stats(),
                "snapshot_error": state.snapshot_errors.get(ns), "tokenizer_error": state.tokenizer_errors.get(ns)}

    @app.get("/v1/namespaces", response_model=list[NamespaceOut])
    async def list_namespaces(principal: Reader):
        return [namespace_out(ns) for ns in sorted(state.specs) if principal is None or principal.may(Role.READ, ns)]

    @app.get("/v1/namespaces/{namespace}", response_model=NamespaceOut)
    async def get_namespace(namespace: Namespace):
        return namespace_out(namespace)

    @app.get("/v1/stats", response_model=dict[str, dict[str, int | float]])
    async def stats(principal: Reader):
        return {ns: v for ns, v in state.engine_stats().items() if principal is None or principal.may(Role.READ, ns)}

    # ------------------------------------------------------------------ corpora, jobs

    @app.get("/v1/namespaces/{namespace}/corpora", response_model=list[CorpusOut])
    async def list_corpora(namespace: Namespace):
        return catalog.list(namespace)

    @app.get("/v1/namespaces/{namespace}/corpora/{name}", response_model=CorpusOut)
    async def get_corpus(namespace: Namespace, name: Name):
        return catalog.get(namespace, name)

    @app.put("/v1/namespaces/{namespace}/corpora/{name}", status_code=202, response_model=JobOut,
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                                            "required": True}})
    async def upload_corpus(request: Request, namespace: AdminNamespace, name: Name,
                            format: Annotated[str, Query(description=f"one of {', '.join(FORMATS)}")] = "jsonl",
                            replace: Annotated[bool, Query(description="replace an existing corpus of this name "
                                                           "atomically (drafts use the old one until the new one is "
                                                           "built); without it an existing name answers 409")] = False,
                            dry_run: Annotated[bool, Query(description="check the token, namespace, name, format and "
                                                           "size only (200, nothing stored); send no body")] = False,
                            upload_bytes: Annotated[int | None, Query(ge=0, description="with dry_run: the size of "
                                                                      "the body the upload will send")] = None,
                            content_length: Annotated[int | None, Header()] = None):
        """Streams the body (a JSONL, text or ids file) to disk; 202 once it is durable. The corpus
        is built in the background (``GET /v1/jobs/{id}``) and becomes visible atomically."""
        if format not in FORMATS:
            raise UploadError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
        size = upload_bytes if dry_run else content_length
        if size is not None and size > state.config.max_upload_bytes:
            raise UploadError(f"upload of {size} bytes exceeds the limit of "
                              f"{state.config.max_upload_bytes} bytes (max_upload_bytes)", 413)
        if dry_run:
            return JSONResponse(catalog.check_upload(namespace, name, replace), status_code=200)
        job = await catalog.upload(namespace, name, format, request.stream(), replace=replace)
        return job.to_dict()

    @app.delete("/v1/namespaces/{namespace}/corpora/{name}", status_code=204, response_class=Response)
    async def delete_corpus(namespace: AdminNamespace, name: Name):
        await catalog.delete(namespace, name)
        return Response(status_code=204)

    @app.get("/v1/jobs/{job_id}", response_model=JobOut)
    async def get_job(job_id: Annotated[str, Path(max_length=64)], principal: Reader):
        job = catalog.jobs.get(job_id)
        if job is None:
            raise KeyError(f"no job '{job_id}' (jobs are kept in memory until the server restarts)")
        require(principal, Role.READ, job.namespace)
        return job.to_dict()

    @app.post("/v1/namespaces/{namespace}/policy-version", response_model=PolicyVersionOut,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": PolicyVersionIn.model_json_schema()}}}})
    async def announce_policy_version(namespace: AdminNamespace, request: Request):
        """The policy's weights changed (an RL step): the namespace's version moves forward (409 for
        an older one; the same one again changes nothing; 400 for a jump past
        --max-policy-version-step). Requests started without a version are sampled by it; prompt
        history the configured number of versions older is dropped. The body is JSON whatever its
        Content-Type (``curl -d`` sends form-urlencoded)."""
        body = await json_body(request, PolicyVersionIn)
        return {"namespace": namespace, "policy_version": await announce(state, namespace, body.version)}

    @app.post("/v1/snapshot", response_model=SnapshotOut)
    async def snapshot(_: Auth):
        if not catalog.persistent and catalog.replication is None:  # a replica snapshots to its blob store
            raise HTTPException(409, "snapshots need --data-dir (NGRAM_CORPUS_DATA_DIR)")
        return {"snapshots": await catalog.snapshot()}

    @app.get("/v1/integrity", response_model=IntegrityOut)
    async def integrity(_: Auth):
        """Checks every native invariant of every namespace (walks every index: an operator's and
        the crash tests' check, too costly for a probe, hence behind the token). 500 if one fails."""
        out, corpora = {}, {}
        for ns in sorted(state.specs):
            try:
                await state.run(state.corpus(ns).check_integrity)
                out[ns] = "ok"
            except AssertionError as e:
                log.error("integrity check of namespace '%s' failed: %s", ns, e)
                out[ns] = f"violated: {e}"
            problems = await asyncio.to_thread(catalog.problems, ns)  # damaged files, catalog vs engine
            if problems:
                corpora[ns] = problems
                if out[ns] == "ok":
                    out[ns] = f"damaged corpora: {', '.join(sorted(problems))}"
        ok = all(v == "ok" for v in out.values())
        return JSONResponse({"ok": ok, "namespaces": out, "corpora": corpora}, status_code=200 if ok else 500)

    return app
