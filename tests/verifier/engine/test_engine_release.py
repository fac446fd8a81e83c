"""An engine is freed when its last reference goes, not at some later garbage collection: a dead
engine kept alive by a reference cycle is torn down by the collector in the middle of whatever runs
next (on a GPU: its CUDA graphs and memory pools freed inside another engine's timed step)."""

import gc
import weakref

import pytest

from tests.verifier.tiny_lm import tiny_lm
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams


@pytest.mark.parametrize("graphs", [False, True])
def test_a_dropped_engine_is_freed_without_a_collection(graphs):
    lm = tiny_lm()
    engine = Engine(lm.model, lm.codec, Drafter(vocab_size=lm.model.config.vocab_size),
                    EngineConfig(max_batch=2, max_len=64, budget=4, max_budget=4, emulate_graphs=graphs))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    gone = weakref.ref(engine)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert gone() is None, "the engine is held by a reference cycle"
    finally:
        if enabled:
            gc.enable()
