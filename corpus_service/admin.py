"""The REST admin (FastAPI): upload, list, get and delete external corpora; jobs; stats; snapshots;
/metrics, /healthz, /readyz. Routes stay thin: the catalog owns the logic, schemas the bodies.

No ``from __future__ import annotations`` here: FastAPI resolves route signatures at run time and
the dependency aliases are local to ``create_admin_app``."""


import hmac
import logging
import time
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from corpus_service.admin_schemas import (CorpusOut, ErrorResponse, JobOut, NamespaceOut, SnapshotOut, StatusOut)
from corpus_service.catalog import Catalog, CorpusConflict
from corpus_service.persistence import check_corpus_name
from corpus_service.service_state import ServiceState
from corpus_service.uploads import FORMATS, UploadError

log = logging.getLogger("corpus_service.admin")
_ERRORS = {c: {"model": ErrorResponse} for c in (400, 401, 403, 404, 409, 413, 503)}


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def create_admin_app(state: ServiceState, catalog: Catalog) -> FastAPI:
    app = FastAPI(title="ngram-corpus admin", version="1", responses=_ERRORS,
                  description="External corpora, jobs, stats and snapshots of the shared n-gram draft corpus.")
    token = state.config.admin_token

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if state.draining:
            raise HTTPException(503, "the corpus server is draining (shutting down)")
        if token is None:  # only allowed on loopback (ServiceConfig refuses otherwise)
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <admin token>)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(authorization[7:].encode(), token.encode()):
            raise HTTPException(403, "wrong admin token")

    Auth = Annotated[None, Depends(require_token)]

    def namespace_dep(namespace: Annotated[str, Path(max_length=64)]) -> str:
        state.corpus(namespace)  # KeyError -> 404
        return namespace

    def name_dep(name: Annotated[str, Path(max_length=64)]) -> str:
        return check_corpus_name(name)

    Namespace = Annotated[str, Depends(namespace_dep)]
    Name = Annotated[str, Depends(name_dep)]

    # ------------------------------------------------------------------ errors: always JSON

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException and unmatched routes
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                503: "unavailable"}.get(exc.status_code, "error")
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
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, "internal", f"internal error: {type(exc).__name__}: {exc}")

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
            return _error(503, "unavailable", "restoring snapshots")
        return {"status": "ready"}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ namespaces, stats

    def namespace_out(ns: str) -> dict:
        corpus = state.corpus(ns)
        spec = state.specs[ns]
        return {"name": ns, "vocab_size": corpus.config.vocab_size, "tokenizer": spec.tokenizer,
                "stats": corpus.stats(), "snapshot_error": state.snapshot_errors.get(ns)}

    @app.get("/v1/namespaces", response_model=list[NamespaceOut])
    async def list_namespaces():
        return [namespace_out(ns) for ns in sorted(state.specs)]

    @app.get("/v1/namespaces/{namespace}", response_model=NamespaceOut)
    async def get_namespace(namespace: Namespace):
        return namespace_out(namespace)

    @app.get("/v1/stats", response_model=dict[str, dict[str, float]])
    async def stats():
        return state.engine_stats()

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
    async def upload_corpus(request: Request, namespace: Namespace, name: Name, _: Auth,
                            format: Annotated[str, Query(description=f"one of {', '.join(FORMATS)}")] = "jsonl",
                            content_length: Annotated[int | None, Header()] = None):
        """Streams the body (a JSONL, text or ids file) to disk; 202 once it is durable. The corpus
        is built in the background (``GET /v1/jobs/{id}``) and becomes visible atomically."""
        if format not in FORMATS:
            raise UploadError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
        if content_length is not None and content_length > state.config.max_upload_bytes:
            raise UploadError(f"upload of {content_length} bytes exceeds the limit of "
                              f"{state.config.max_upload_bytes} bytes (max_upload_bytes)", 413)
        job = await catalog.upload(namespace, name, format, request.stream())
        return job.to_dict()

    @app.delete("/v1/namespaces/{namespace}/corpora/{name}", status_code=204, response_class=Response)
    async def delete_corpus(namespace: Namespace, name: Name, _: Auth):
        await catalog.delete(namespace, name)
        return Response(status_code=204)

    @app.get("/v1/jobs/{job_id}", response_model=JobOut)
    async def get_job(job_id: Annotated[str, Path(max_length=64)]):
        job = catalog.jobs.get(job_id)
        if job is None:
            raise KeyError(f"no job '{job_id}' (jobs are kept in memory until the server restarts)")
        return job.to_dict()

    @app.post("/v1/snapshot", response_model=SnapshotOut)
    async def snapshot(_: Auth):
        if not catalog.persistent:
            raise HTTPException(409, "snapshots need --data-dir (NGRAM_CORPUS_DATA_DIR)")
        return {"snapshots": await catalog.snapshot()}

    return app
