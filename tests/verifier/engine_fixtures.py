"""Shared helpers for the engine/API tests on the real model."""

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from verifier.api import create_app
from verifier.api.policy_version import PolicyAnnouncer
from verifier.api.weights import WeightUpdater
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.engine.runner import EngineLoop
from verifier.step.sampling import SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


def engine(lm, drafter: Drafter | None, budget: int = 7, max_batch: int = 4, **config) -> Engine:
    return Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=max_batch, max_len=640,
                                                           budget=budget if drafter else 0, max_budget=15, **config))


@contextlib.contextmanager
def serve_api(lm, budget: int, timeout: float = 120, drafter: Drafter | None = None, weights_from: str | None = None):
    """A real uvicorn server on a 127.0.0.1 ephemeral port over an engine with the local corpus (or
    ``drafter``); yields an httpx client for it. ``weights_from``: POST /v1/update-weights on, with
    this model spec as the default source of new weights."""
    drafter = drafter or Drafter(vocab_size=lm.model.config.vocab_size)
    loop = EngineLoop(engine(lm, drafter, budget=budget)).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    announcer = PolicyAnnouncer(drafter)
    weights = WeightUpdater(loop, weights_from or "", announcer, enabled=weights_from is not None)
    server = uvicorn.Server(uvicorn.Config(create_app(loop, "smollm2", announcer=announcer, weights=weights),
                                           log_level="warning"))
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
