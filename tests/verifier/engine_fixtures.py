"""Shared helpers for the engine/API tests on the real model."""

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from verifier.api import create_app
from verifier.api.admin import AdminAccess
from verifier.api.policy_version import PolicyAnnouncer
from verifier.api.weights import WeightUpdater
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.engine.runner import EngineLoop
from verifier.step.sampling import SamplingParams

MAX_TOKENS = 24
ADMIN_KEY = "admin-key-of-the-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the headers of an admin route's caller
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


def engine(lm, drafter: Drafter | None, budget: int = 7, max_batch: int = 4, max_len: int = 640, **config) -> Engine:
    return Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=max_batch, max_len=max_len,
                                                           budget=budget if drafter else 0, max_budget=15, **config))


@contextlib.contextmanager
def serve_api(lm, budget: int, timeout: float = 120, drafter: Drafter | None = None, weights_from: str | None = None,
              weights_dir: str = "", policy_version: bool = False, api_key: str = "", max_len: int = 640):
    """A real uvicorn server on a 127.0.0.1 ephemeral port over an engine with the local corpus (or
    ``drafter``); yields an httpx client for it. ``weights_from``: POST /v1/update-weights on, with
    this model spec as the default source of new weights (and others from ``weights_dir``);
    ``policy_version``: POST /v1/policy-version on. Both need the ``ADMIN`` headers."""
    drafter = drafter or Drafter(vocab_size=lm.model.config.vocab_size)
    loop = EngineLoop(engine(lm, drafter, budget=budget, max_len=max_len)).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    announcer = PolicyAnnouncer(drafter)
    weights = WeightUpdater(loop, weights_from or "", announcer, enabled=weights_from is not None,
                            weights_dir=weights_dir)
    admin = AdminAccess(ADMIN_KEY, policy_version=policy_version)
    app = create_app(loop, "smollm2", api_key, announcer=announcer, weights=weights, admin=admin)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=timeout) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        loop.stop()
