"""Request and response bodies of the REST admin (documented in the OpenAPI schema at /docs)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    code: str = Field(description="a short machine-readable reason, e.g. 'not_found'")
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class JobOut(BaseModel):
    id: str
    namespace: str
    corpus: str
    state: str = Field(description="queued | running | done | failed | cancelled")
    progress: float = Field(description="fraction of the uploaded bytes processed")
    bytes_total: int
    bytes_done: int
    documents: int
    tokens: int
    error: str
    created_at: float
    finished_at: float | None


class CorpusOut(BaseModel):
    name: str
    namespace: str
    state: str = Field(description="acknowledged | building | ready | failed")
    tokens: int
    source: str = Field(description="'upload' (REST, rebuilt from its file after a restart) or 'grpc'")
    format: str | None = None
    bytes: int | None = None
    job_id: str | None = None
    created_at: float | None = None
    error: str | None = None


class NamespaceOut(BaseModel):
    name: str
    vocab_size: int
    tokenizer: str | None
    stats: dict[str, float]
    snapshot_error: str | None = None


class SnapshotOut(BaseModel):
    snapshots: dict[str, str] = Field(description="namespace -> snapshot file")


class StatusOut(BaseModel):
    status: str
    detail: str | None = None


class IntegrityOut(BaseModel):
    ok: bool
    namespaces: dict[str, str] = Field(description="namespace -> 'ok' or the first violated invariant")
