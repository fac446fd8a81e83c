"""Request and response bodies of the REST admin (documented in the OpenAPI schema at /docs)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
    state: str = Field(description="acknowledged | building | ready | failed | damaged (error says why; delete "
                       "or replace it)")
    tokens: int
    source: str = Field(description="'upload' (REST) or 'grpc' (LoadExternalCorpus); both are rebuilt from "
                        "their file after a restart; 'unknown' for a damaged manifest")
    format: str | None = None
    bytes: int | None = None
    job_id: str | None = None
    created_at: float | None = None
    error: str | None = None


class NamespaceOut(BaseModel):
    name: str
    vocab_size: int
    tokenizer: str | None = Field(description="the tokenizer spec's name ('smollm2', a file's name); null if none")
    stats: dict[str, int | float] = Field(description="counters as integers; seconds and ratios as numbers")
    snapshot_error: str | None = None
    tokenizer_error: str | None = Field(None, description="why the namespace's tokenizer cannot be loaded")


class SnapshotOut(BaseModel):
    snapshots: dict[str, str] = Field(description="namespace -> snapshot file")


class StatusOut(BaseModel):
    status: str
    detail: str | None = None


class IntegrityOut(BaseModel):
    ok: bool
    namespaces: dict[str, str] = Field(description="namespace -> 'ok', the first violated invariant, or the "
                                       "damaged corpora")
    corpora: dict[str, dict[str, str]] = Field(default_factory=dict,
                                               description="namespace -> corpus -> what is wrong with it")


class UploadCheckOut(BaseModel):
    namespace: str
    name: str
    replace: bool
    exists: bool = Field(description="a corpus of this name exists (a PUT needs replace=true)")


class PolicyVersionIn(BaseModel):
    # Strict: JSON's true is no version 1; unknown fields are refused (a typo must not pass unnoticed).
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(ge=0, le=(1 << 62) - 1, description="the policy version now sampling (an RL step); "
                         "versions only move forward, by at most the server's --max-policy-version-step at once")


class PolicyVersionOut(BaseModel):
    namespace: str
    policy_version: int = Field(description="the namespace's policy version after the call")
