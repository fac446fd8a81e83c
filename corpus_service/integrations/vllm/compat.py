"""Which vLLM the plugin patches, and the patch itself.

The V1 GPU model runner (``vllm/v1/worker/gpu_model_runner.py``) imports ``SuffixDecodingProposer``
by name from ``vllm.v1.spec_decode.suffix_decoding`` and builds it as
``SuffixDecodingProposer(vllm_config)`` when ``speculative_config.method == "suffix"``, then calls
``propose(num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=...)`` after an
``isinstance`` check against the same name. So the patch puts a subclass under that name in both
modules: the proposer's own module now, the runner's when it is already imported (otherwise the
runner's import picks the subclass up: vLLM's worker loads general plugins before it imports the
runner). Model Runner V2 (``vllm/v1/worker/gpu/``) builds its speculators elsewhere and, in
0.33.0, does not run ``suffix`` (vLLM falls back to the V1 runner for it), so it is not patched.
"""

from __future__ import annotations

import inspect
import sys

SUPPORTED_VERSIONS = ("0.33.0",)  # the versions whose proposer and runner this was checked against
PROPOSER_MODULE = "vllm.v1.spec_decode.suffix_decoding"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
CLASS_NAME = "SuffixDecodingProposer"
# vLLM 0.33.0's signatures, parameter names in order: what the subclass relies on.
INIT_PARAMS = ("self", "vllm_config")
PROPOSE_PARAMS = ("self", "num_speculative_tokens", "input_batch", "sampled_token_ids", "slot_mappings")


def _params(fn: object) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def check_engine() -> tuple[str, type | None]:
    """('', vLLM's proposer class) when this vLLM is one the plugin supports, else (why not, None).
    Imports only the proposer's module (light: no model runner, no CUDA)."""
    try:
        import vllm
    except ImportError:
        return "vLLM is not importable in this environment", None
    version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        return f"vLLM {version} is not a supported version ({', '.join(SUPPORTED_VERSIONS)})", None
    try:
        module = __import__(PROPOSER_MODULE, fromlist=[CLASS_NAME])
    except Exception as e:
        return f"vLLM {version}: cannot import {PROPOSER_MODULE} ({type(e).__name__}: {e})", None
    base = getattr(module, CLASS_NAME, None)
    if not isinstance(base, type):
        return f"vLLM {version}: {PROPOSER_MODULE} has no class {CLASS_NAME}", None
    base = getattr(base, "__ngram_corpus_base__", base)  # already patched in this process
    init, propose = _params(base.__init__), _params(getattr(base, "propose", None) or (lambda: None))
    if init != INIT_PARAMS or propose != PROPOSE_PARAMS:
        return (f"vLLM {version}: {CLASS_NAME} has __init__{init} and propose{propose}, "
                f"not __init__{INIT_PARAMS} and propose{PROPOSE_PARAMS}"), None
    return "", base


def apply(base: type, patched: type) -> list[str]:
    """Puts ``patched`` under vLLM's name in the proposer's module and in every loaded module that
    imported the name (the runner); returns those modules' names."""
    patched.__ngram_corpus_base__ = base  # type: ignore[attr-defined]
    done = []
    for name in (PROPOSER_MODULE, RUNNER_MODULE):
        module = sys.modules.get(name)
        if module is not None and getattr(module, CLASS_NAME, None) in (base, patched):
            setattr(module, CLASS_NAME, patched)
            done.append(name)
    return done
