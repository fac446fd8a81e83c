"""EngineLoop's updates: a streaming caller gets one per step that gave its request tokens, a
non-streaming one (``progress=False``) only the final state, with the whole output; a step's
updates reach the event loop in one call, not one per request."""

import asyncio

from tiny_lm import tiny_lm

from verifier.engine.core import Engine, EngineConfig
from verifier.engine.runner import EngineLoop
from verifier.step.sampling import SamplingParams


async def _updates(loop: EngineLoop, progress: bool) -> list:
    _, queue = loop.submit([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), progress=progress)
    got = []
    while not got or not got[-1].finished:
        got.append(await asyncio.wait_for(queue.get(), 60))
    return got


def test_progress_updates_only_when_asked():
    lm = tiny_lm(vocab_size=16, seed=0)
    loop = EngineLoop(Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=32, budget=0))).start()
    try:
        steps = asyncio.run(_updates(loop, True))
        final = asyncio.run(_updates(loop, False))
    finally:
        loop.stop()
    assert len(steps) > 1 and [len(u.output_ids) for u in steps] == sorted(len(u.output_ids) for u in steps)
    assert len(final) == 1 and final[0].finished and final[0].output_ids == steps[-1].output_ids


def test_a_steps_updates_reach_the_event_loop_together():
    lm = tiny_lm(vocab_size=16, seed=0)
    loop = EngineLoop(Engine(lm.model, lm.codec, None, EngineConfig(max_batch=4, max_len=32, budget=0))).start()

    async def streams():
        aio = asyncio.get_running_loop()
        calls = []
        inner = aio.call_soon_threadsafe
        aio.call_soon_threadsafe = lambda *a: calls.append(a) or inner(*a)
        queues = [loop.submit([1, 2, 3 + i], SamplingParams(max_tokens=8, ignore_eos=True))[1] for i in range(4)]
        got = [[] for _ in queues]
        for q, g in zip(queues, got):
            while not g or not g[-1].finished:
                g.append(await asyncio.wait_for(q.get(), 60))
        return got, calls

    try:
        got, calls = asyncio.run(streams())
    finally:
        loop.stop()
    updates = sum(map(len, got))
    assert all(g[-1].finished and len(g[-1].output_ids) == 8 for g in got)
    assert updates >= 4 * 6 and len(calls) <= updates // 3, (updates, len(calls))  # ~one per step of 4
