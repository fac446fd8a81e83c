"""The speculative engine: the step loop (``core.py``; the step's parts in ``prefill.py``, ``verify.py``,
``sampled.py``, ``commit.py`` and ``overlap.py``, its config in ``config.py``), requests and their admission (``request.py``,
``scheduler.py``) and the thread that runs the engine for the HTTP API (``runner.py``).

``from verifier.engine import Engine`` still works: the names of ``core`` are handed on lazily, so that
importing ``verifier.engine.request`` (which ``verifier.step`` and ``verifier.api`` use) does not load
the engine, whose ``core`` imports those step modules in turn."""

_CORE = ("Engine", "EngineConfig", "EngineStats", "graph_prefill_chunks", "prefill_chunks")


def __getattr__(name: str):
    if name in _CORE:
        from . import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_CORE)
