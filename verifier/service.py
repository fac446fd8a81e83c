"""Builds a verifier from its config (model, corpus drafter, engine) and serves the HTTP API."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass

import torch

from .config import VerifierConfig
from corpus_service.client import check_namespace, model_ids
from ngram_common.gc_heap import freeze_startup_heap
from .draft.drafter import Drafter
from .draft.external_corpora import load_external_corpora
from .engine.core import Engine
from .engine.runner import EngineLoop
from .model import load_model
from .model.loader import LoadedModel

log = logging.getLogger("verifier")

# The start-up namespace check's deadline: room for a corpus loading its tokenizer on the first Stats
# call (seconds for a GGUF); a corpus that is down answers at once (connection refused).
NAMESPACE_CHECK_TIMEOUT_S = 30.0


@dataclass
class Verifier:
    config: VerifierConfig
    engine: Engine
    model_name: str


def build_verifier(cfg: VerifierConfig, lm: LoadedModel | None = None) -> Verifier:
    """``lm``: the model already loaded as ``cfg`` says (the offline generator reads its prompts with
    the tokenizer first, to size the KV cache)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    if lm is None:
        lm = load_model(cfg.model, cfg.device, cfg.dtype, cfg.weight_noise_sigma, cfg.weight_noise_seed)
    log.info("model %s: %d layers, %.0fM parameters, %s on %s%s", lm.name, lm.model.config.num_layers,
             lm.model.config.num_params / 1e6, cfg.dtype, cfg.device,
             f", linear weights perturbed (sigma {cfg.weight_noise_sigma:g}, seed {cfg.weight_noise_seed})"
             if cfg.weight_noise_sigma else "")
    served = cfg.served_model_name or lm.name
    drafter = None
    if cfg.corpus != "none":
        corpus, check = "local", None
        if cfg.corpus != "local":
            corpus = cfg.corpus_endpoint(served)
            check = functools.partial(check_namespace, corpus.target, corpus.namespace,
                                      model_ids(lm.codec, lm.model.config.vocab_size), token=corpus.token,
                                      tls=corpus.tls, timeout_s=NAMESPACE_CHECK_TIMEOUT_S)
        drafter = Drafter(corpus, cfg.draft, vocab_size=lm.model.config.vocab_size, check=check)
    if cfg.external_corpus:  # before the engine exists: no request drafts from a half-loaded corpus
        load_external_corpora(drafter.local, cfg.external_corpus, lm.codec.tokenizer)
    engine = Engine(lm.model, lm.codec, drafter, cfg.engine_config())
    return Verifier(cfg, engine, served)


def serve(cfg: VerifierConfig) -> None:
    import uvicorn

    from .api import create_app
    from .api.admin import AdminAccess
    from .api.lifecycle import DrainingServer
    from .api.policy_version import PolicyAnnouncer
    from .api.weights import WeightUpdater

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in cfg.startup_warnings():
        log.warning("SECURITY WARNING: %s", line)
    v = build_verifier(cfg)
    threading.Thread(target=v.engine.grammars.warm, name="grammar-warmup", daemon=True).start()
    loop = EngineLoop(v.engine).start()
    d = v.engine.drafter
    announcer = PolicyAnnouncer(d, namespace=d.health.namespace if d is not None and d.health is not None else "default",
                                token=cfg.corpus_token or None, tls=cfg.corpus_tls_ca or None)
    weights = WeightUpdater(loop, cfg.model, announcer, enabled=cfg.allow_weight_updates, weights_dir=cfg.weights_dir)
    app = create_app(loop, v.model_name, cfg.api_key, announcer, weights,
                     AdminAccess(cfg.admin_key, policy_version=cfg.allow_policy_version), cfg.lifecycle_config())
    log.info("start-up heap frozen: %d objects out of the garbage collector's scans", freeze_startup_heap())
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    # Listening before the port is published: a client that reads the ports file and connects at
    # once waits in the backlog until the server accepts, instead of being refused (uvicorn listens
    # again on start-up, which keeps the queue).
    sock.listen(2048)
    port = sock.getsockname()[1]
    if cfg.ports_file:
        tmp = cfg.ports_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"http_port": port}, f)
        os.replace(tmp, cfg.ports_file)  # readers never see a partial file
    log.info("serving %s on http://%s:%d (corpus: %s%s)", v.model_name, cfg.host, port, cfg.corpus,
             f", namespace {d.health.namespace}" if d is not None and d.health is not None else "")
    # uvicorn's own graceful-shutdown timeout is only the backstop: DrainingServer aborts the live
    # requests at --shutdown-timeout, and their handlers answer at once.
    server = DrainingServer(uvicorn.Config(app, log_level=cfg.log_level.lower(), access_log=False,
                                           timeout_graceful_shutdown=cfg.shutdown_timeout + 5), app.state.lifecycle)
    # uvicorn re-raises the signal that stopped it once it is done, with the handlers it found: with
    # the default ones SIGTERM would kill the process (exit -15) after a clean drain, and SIGINT
    # raise KeyboardInterrupt. The drained shutdown exits 0. (A signal just before uvicorn takes
    # them over stops it as soon as it starts.)
    def stop(signum, frame) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.stop()
        if v.engine.drafter is not None:
            v.engine.drafter.close()

