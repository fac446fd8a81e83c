"""Shared helpers for the engine/API tests on the real model."""

from verifier.drafter import Drafter
from verifier.engine import Engine, EngineConfig
from verifier.sampling import SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


def engine(lm, drafter: Drafter | None, budget: int = 7, max_batch: int = 4) -> Engine:
    return Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=max_batch, max_len=640,
                                                           budget=budget if drafter else 0, max_budget=15))
