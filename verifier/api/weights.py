"""``POST /v1/update-weights``: new policy weights into the running verifier, without a restart.

An RL loop changes the policy's weights every step; restarting a replica for each change costs its
start-up (model load, kernels, CUDA graph capture) and its in-process corpus. The update reads the
weights (``model``: a .gguf file or HF directory of the same architecture, by default the one served,
optionally perturbed as ``--weight-noise-sigma/--weight-noise-seed`` do), then, as SGLang's
``update_weights_from_disk`` does, holds new requests back, lets the running ones finish with the old
weights (``drain_timeout_s``), copies the new ones into the live tensors (same addresses: the CUDA graphs
stay valid) and lets the held requests in. With ``policy_version`` it then announces the new version to
the corpus (as ``POST /v1/policy-version``). Off unless the verifier runs with ``--allow-weight-updates``
(and then only with its admin key, ``admin.py``): the route reads files named by its caller, so only
from ``--weights-dir``: a ``model`` outside it (after symlinks) is refused with 403 before anything
on disk is touched, and the answer does not say whether the path exists. The served model's own spec
(the default) is always allowed. Anything wrong with the files is 400 ``bad_weights`` (counted in
``failed_updates``); weights holding NaN or Inf are refused before any copy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ..engine.runner import EngineLoop
from ..model.loader import check_weights, copy_weights_, read_weights
from .body import ApiError
from .policy_version import PolicyAnnouncer
from .schemas import MAX_POLICY_VERSION

log = logging.getLogger(__name__)


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    model: str | None = Field(default=None, min_length=1, max_length=4096)
    weight_noise_sigma: float = Field(default=0.0, ge=0.0, le=1.0)
    weight_noise_seed: int = Field(default=0, ge=0, lt=2**63)
    policy_version: int | None = Field(default=None, ge=0, le=MAX_POLICY_VERSION)
    drain_timeout_s: float = Field(default=600.0, gt=0.0, le=3600.0)


@dataclass
class WeightUpdater:
    loop: EngineLoop
    model: str  # what the verifier loaded: the default source of new weights
    announcer: PolicyAnnouncer  # where policy_version goes (409 without a corpus)
    enabled: bool = False
    weights_dir: str = ""  # where other weights may come from ('' = only the served model's)
    updates: int = 0
    failures: int = 0
    last: dict = field(default_factory=dict)
    _open: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def __post_init__(self) -> None:
        self._open.set()

    @property
    def updating(self) -> bool:
        return not self._open.is_set()

    async def admit(self) -> None:
        """New requests wait here while an update drains the running ones and copies the weights."""
        await self._open.wait()

    def state(self) -> dict:
        """For /healthz: whether updates are on, how many were made, the last one, and whether one holds
        requests back now."""
        return {"updates_enabled": self.enabled, "updates": self.updates, "failed_updates": self.failures,
                "updating": self.updating, "last": self.last}

    async def update(self, body: UpdateWeightsRequest) -> dict:
        if not self.enabled:
            raise ApiError(403, "update-weights: this verifier was started without --allow-weight-updates",
                           None, "weight_updates_disabled")
        if self._lock.locked():
            raise ApiError(409, "update-weights: another update is in progress", None, "update_in_progress")
        async with self._lock:
            try:
                return await self._update(body)
            except ApiError as e:
                self.failures += 1
                log.warning("weight update failed (HTTP %d): %s", e.status, e.message)
                raise

    def source(self, model: str | None) -> str:
        """The model spec to read: the served one (``model`` None or the same spec), or a path under
        ``weights_dir`` (relative paths are taken from it); ApiError 403 otherwise, decided on the
        name alone (the answer says nothing of what exists outside the directory)."""
        if model is None or model == self.model:
            return self.model
        refused = ApiError(403, "update-weights: model must name a .gguf file or HF directory under the verifier's "
                           "--weights-dir" + ("" if self.weights_dir else " (none is configured: only the served "
                                              "model's own weights, optionally perturbed)"),
                           "model", "weights_outside_dir")
        if not self.weights_dir or "\x00" in model:
            raise refused
        root = os.path.realpath(self.weights_dir)
        path = os.path.realpath(os.path.join(root, os.path.expanduser(model)))  # (an absolute model stays as is)
        if path == root or os.path.commonpath([root, path]) != root:
            raise refused
        return path

    async def _update(self, body: UpdateWeightsRequest) -> dict:
        t0 = time.monotonic()
        source = self.source(body.model)
        engine = self.loop.engine
        try:
            cfg, state = await asyncio.to_thread(read_weights, source, body.weight_noise_sigma, body.weight_noise_seed)
            check_weights(engine.model, cfg, state)
        except (ValueError, OSError, ImportError) as e:  # a missing file, another architecture, a bad checkpoint
            raise ApiError(400, f"update-weights: {str(e)[:500]}", "model", "bad_weights") from None
        except Exception as e:  # a reader's own failure on a malformed file (gguf, safetensors): still the file's
            log.warning("weight update: reading %s failed: %s: %s", source, type(e).__name__, e)
            raise ApiError(400, f"update-weights: the weights could not be read ({type(e).__name__}: {str(e)[:200]})",
                           "model", "bad_weights") from None
        read_s = time.monotonic() - t0
        self._open.clear()
        try:
            running = engine.scheduler.num_unfinished

            def swap() -> int:
                engine.quiesce()
                return copy_weights_(engine.model, cfg, state)

            fut = self.loop.call_when_idle(swap)
            wrapped = asyncio.wrap_future(fut)
            done, _ = await asyncio.wait({wrapped}, timeout=body.drain_timeout_s)
            if not done and fut.cancel():
                raise ApiError(503, f"update-weights: {engine.scheduler.num_unfinished} requests were still running "
                               f"after drain_timeout_s = {body.drain_timeout_s:g} s; the weights are unchanged",
                               "drain_timeout_s", "drain_timeout")
            values = await wrapped  # (also when the copy had started as the wait ran out)
        finally:
            self._open.set()
        self.updates += 1
        self.last = {"model": source, "weight_noise_sigma": body.weight_noise_sigma,
                     "weight_noise_seed": body.weight_noise_seed, "at": time.time()}
        out = {"model": source, "values": values, "drained_requests": running, "read_s": round(read_s, 3),
               "seconds": round(time.monotonic() - t0, 3), "updates": self.updates}
        log.info("weights updated from %s (sigma %g, seed %d): %d values, %d running requests drained, %.2f s",
                 source, body.weight_noise_sigma, body.weight_noise_seed, values, running, out["seconds"])
        if body.policy_version is not None:
            try:
                out["policy_version"] = await asyncio.to_thread(self.announcer.announce, body.policy_version)
            except ApiError as e:  # the weights are in: say so, so that a retry is understood as harmless
                raise ApiError(e.status, f"the weights were updated, but the policy version was not announced: "
                               f"{e.message}", e.param, e.code) from None
        return out
