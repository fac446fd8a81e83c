"""A small client of the REST admin (used by the CLI and the tests)."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

_CHUNK = 1 << 20


def _flag(value: bool) -> str:
    return "true" if value else "false"


class AdminError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class AdminClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, tls_ca: str | None = None) -> None:
        """``tls_ca``: a PEM CA bundle to verify an https admin with (default: the system's roots)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise AdminError(r.status_code, msg)
        return r.json() if r.content else None

    def check_upload(self, namespace: str, name: str, fmt: str, replace: bool = False, size: int | None = None) -> dict:
        """What ``upload`` would meet, without sending the file: AdminError for a refused token,
        an unknown namespace, a bad name or format, a taken name (409, unless ``replace``) or a
        ``size`` beyond the server's limit (413)."""
        params = {"format": fmt, "replace": _flag(replace), "dry_run": "true"}
        if size is not None:
            params["upload_bytes"] = str(size)
        return self._call("PUT", f"/v1/namespaces/{namespace}/corpora/{name}", params=params)

    def upload(self, namespace: str, name: str, path: str | os.PathLike[str], fmt: str,
               on_bytes: Callable[[int], None] | None = None, replace: bool = False) -> dict:
        """Streams a file; returns the job once the server acknowledged the upload (durable).
        ``replace``: an existing corpus of the name is swapped out once the new one is built."""
        size = Path(path).stat().st_size

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    yield chunk
                    if on_bytes:
                        on_bytes(len(chunk))

        return self._call("PUT", f"/v1/namespaces/{namespace}/corpora/{name}",
                          params={"format": fmt, "replace": _flag(replace)},
                          content=chunks(), headers={"Content-Length": str(size),
                                                     "Content-Type": "application/octet-stream"})

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def wait_job(self, job_id: str, timeout: float = 3600.0, poll_s: float = 0.05,
                 on_progress: Callable[[dict], None] | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if on_progress:
                on_progress(job)
            if job["state"] not in ("queued", "running"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout}s")
            time.sleep(poll_s)

    def corpora(self, namespace: str) -> list[dict]:
        return self._call("GET", f"/v1/namespaces/{namespace}/corpora")

    def delete(self, namespace: str, name: str) -> None:
        self._call("DELETE", f"/v1/namespaces/{namespace}/corpora/{name}")

    def namespace(self, namespace: str) -> dict:
        return self._call("GET", f"/v1/namespaces/{namespace}")

    def namespaces(self) -> list[dict]:
        return self._call("GET", "/v1/namespaces")

    def stats(self) -> dict:
        return self._call("GET", "/v1/stats")

    def snapshot(self) -> dict:
        return self._call("POST", "/v1/snapshot")

    def announce_policy_version(self, namespace: str, version: int) -> int:
        """The policy's weights changed: ``namespace``'s policy version moves forward to ``version``
        (AdminError 409 for an older one). Returns the namespace's version."""
        return self._call("POST", f"/v1/namespaces/{namespace}/policy-version", json={"version": version})["policy_version"]
