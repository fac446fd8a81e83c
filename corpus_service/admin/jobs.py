"""Background builds of uploaded corpora, one at a time, with progress.

A build reads the acknowledged data file, tokenizes text in batches with the namespace's tokenizer,
loads the documents into the engine invisibly and commits them atomically; the manifest then says
``ready`` (or ``failed`` with the reason).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from corpus_service.admin.persistence import FAILED, READY, DataDir, Manifest
from corpus_service.admin.uploads import read_documents
from corpus_service.engine.tokenizer import Tokenizers
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.jobs")
_TEXT_BATCH = 256  # documents per encode_batch call (the tokenizer parallelizes inside a batch)

QUEUED, RUNNING, DONE, CANCELLED = "queued", "running", "done", "cancelled"


def new_job_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(slots=True)
class Job:
    id: str
    namespace: str
    corpus: str
    bytes_total: int
    state: str = QUEUED  # queued | running | done | failed | cancelled
    bytes_done: int = 0
    documents: int = 0
    tokens: int = 0
    error: str = ""
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def progress(self) -> float:
        return 1.0 if self.state == DONE else (self.bytes_done / self.bytes_total if self.bytes_total else 0.0)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cancel"}
        d["progress"] = round(self.progress(), 4)
        return d


class Jobs:
    def __init__(self, state: ServiceState, data: DataDir, tokenizers: Tokenizers,
                 lock: threading.RLock | None = None) -> None:
        self.state, self.data, self.tokenizers = state, data, tokenizers
        # The catalog's lock: a build commits and records its manifest under it, after checking it
        # was not cancelled (a DELETE or a replacement), so a cancelled build never resurrects.
        self.commit_lock = lock if lock is not None else threading.RLock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="corpus-build")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}

    def submit(self, manifest: Manifest) -> Job:
        job = Job(manifest.job_id or new_job_id(), manifest.namespace, manifest.name, manifest.bytes)
        with self._lock:
            self._jobs[job.id] = job
        self._executor.submit(self._run, job, manifest)
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def active(self, namespace: str, name: str) -> Job | None:
        with self._lock:
            for job in self._jobs.values():
                if job.namespace == namespace and job.corpus == name and job.state in (QUEUED, RUNNING):
                    return job
        return None

    def cancel(self, namespace: str, name: str) -> None:
        job = self.active(namespace, name)
        if job is not None:
            job.cancel.set()

    def wait_idle(self) -> None:
        """Blocks until every submitted build has finished (shutdown, tests)."""
        self._executor.submit(lambda: None).result()

    def shutdown(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _run(self, job: Job, manifest: Manifest) -> None:
        if job.cancel.is_set():
            job.state, job.finished_at = CANCELLED, time.time()
            return
        job.state = RUNNING
        corpus = self.state.corpus(job.namespace)
        name = job.corpus
        t0 = time.perf_counter()
        try:
            # replace: the manifest is the authority; a corpus of the name already in the engine
            # (the one a replacement supersedes) keeps drafting until the commit swaps this one in.
            corpus.begin_external_corpus(name, replace=True)
            try:
                self._load(job, corpus, manifest)
                with self.commit_lock:
                    if job.cancel.is_set():
                        raise _Cancelled()
                    count = corpus.commit_external_corpus(name)
                    job.tokens = count
                    manifest.state, manifest.tokens, manifest.documents, manifest.error = READY, count, job.documents, ""
                    self.data.write_manifest(manifest)
            except BaseException:
                if corpus.is_loading_external_corpus(name):
                    corpus.abort_external_corpus(name)
                raise
        except _Cancelled:
            job.state, job.finished_at = CANCELLED, time.time()
            log.info("build of '%s/%s' cancelled", job.namespace, name)
            return
        except Exception as e:  # noqa: BLE001 - a failed build is reported on the job and manifest
            reason = _reason(e)
            job.state, job.error, job.finished_at = FAILED, reason, time.time()
            with self.commit_lock:
                if not job.cancel.is_set():  # a DELETE's tombstone stays a tombstone
                    manifest.state, manifest.error = FAILED, reason
                    self.data.write_manifest(manifest)
            log.error("build of '%s/%s' failed: %s", job.namespace, name, e)
            return
        job.state, job.bytes_done, job.finished_at = DONE, job.bytes_total, time.time()
        dt = time.perf_counter() - t0
        log.info("built '%s/%s': %d documents, %d tokens in %.2fs (%.0f tokens/s)", job.namespace, name,
                 job.documents, count, dt, count / dt if dt else 0.0)

    def _load(self, job: Job, corpus, manifest: Manifest) -> None:
        has_tok = self.tokenizers.has(job.namespace)
        texts: list[str] = []

        def flush_texts() -> None:
            if not texts:
                return
            encodings = self.tokenizers.get(job.namespace).encode_batch(texts, add_special_tokens=False)
            for enc in encodings:
                self._add(job, corpus, enc.ids)
            texts.clear()

        for pos, kind, payload in read_documents(self.data.data_path(job.namespace, job.corpus), manifest.format,
                                                 corpus.config.vocab_size, has_tok):
            if job.cancel.is_set():
                raise _Cancelled()
            if kind == "text":
                texts.append(payload)
                if len(texts) >= _TEXT_BATCH:
                    flush_texts()
            else:
                self._add(job, corpus, payload)
            job.bytes_done = pos
        flush_texts()

    @staticmethod
    def _add(job: Job, corpus, ids) -> None:
        if len(ids):
            corpus.add_external_chunk(job.corpus, ids)
            job.documents += 1
            job.tokens += len(ids)


class _Cancelled(Exception):
    pass


def _reason(e: Exception) -> str:
    """What the job and the manifest say about a failed build: no server path (an OSError's str()
    names the file; the log line keeps it)."""
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e.strerror or 'I/O error'}"
    return str(e)
