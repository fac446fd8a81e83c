"""GPU verifier worker: target model, tree attention, CUDA tree-verify kernels (torch reference on CPU).

``from verifier import LLM, SamplingParams``: offline rollouts in process (``verifier.generate``),
imported on first use (torch is the verifier extra's)."""

_LAZY = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str):
    if name in _LAZY:
        from . import generate

        return getattr(generate, name)
    raise AttributeError(f"module 'verifier' has no attribute {name!r}")
