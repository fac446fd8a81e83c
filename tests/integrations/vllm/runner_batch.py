"""vLLM's real ``InputBatch``, driven as the V1 GPU model runner drives it between proposer calls.

Runs inside a process that has vLLM on its path (``scenarios.py``). The runner adds a scheduled
request (``add_request``), writes each step's sampled tokens into ``token_ids_cpu`` and moves
``num_tokens_no_spec`` (``_bookkeeping_sync`` in ``gpu_model_runner.py``), removes finished
requests and condenses; ``propose`` then sees ``(input_batch, sampled_token_ids)``. A CPU has no
pinned memory, so vLLM's ``PIN_MEMORY`` switch is turned off before the batch is built."""

from __future__ import annotations

import sys
from types import SimpleNamespace

MAX_MODEL_LEN = 512


def _cpu_only() -> None:
    import vllm.utils.torch_utils as torch_utils

    torch_utils.PIN_MEMORY = False
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
            module.PIN_MEMORY = False


def proposer_config(k: int, max_model_len: int = MAX_MODEL_LEN) -> SimpleNamespace:
    """What the proposer reads of a ``VllmConfig``: vLLM's real ``SpeculativeConfig`` for method
    'suffix' (its defaults) and the model's max_model_len (a whole ``VllmConfig`` needs a device
    and a model)."""
    from vllm.config import SpeculativeConfig

    return SimpleNamespace(speculative_config=SpeculativeConfig(method="suffix", num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


class RunnerBatch:
    def __init__(self, max_num_reqs: int = 8, max_model_len: int = MAX_MODEL_LEN, k: int = 8) -> None:
        _cpu_only()
        import torch
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.batch = InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                                max_num_batched_tokens=max_num_reqs * max_model_len, device=torch.device("cpu"),
                                vocab_size=50_000, block_sizes=[16], max_num_blocks_per_req=[max_model_len // 16],
                                num_spec_tokens=k)

    def add(self, req_id: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        self.batch.add_request(CachedRequestState(
            req_id=req_id, prompt_token_ids=list(prompt), mm_features=[], sampling_params=SamplingParams(temperature=0.0),
            generator=None, block_ids=([],), num_computed_tokens=0, output_token_ids=[]))

    def remove(self, req_id: str) -> None:
        self.batch.remove_request(req_id)
        self.batch.condense()

    def sample(self, sampled: dict[str, list[int]]) -> list[list[int]]:
        """Writes each request's sampled tokens as the runner does; returns ``sampled_token_ids``
        in batch order ([] for a request without tokens this step: a partial prefill)."""
        b = self.batch
        out = []
        for i, req_id in enumerate(b.req_ids):
            ids = list(sampled.get(req_id, []))
            if ids:
                start = int(b.num_tokens_no_spec[i])
                b.token_ids_cpu[i, start:start + len(ids)] = ids
                b.num_tokens_no_spec[i] = start + len(ids)
            out.append(ids)
        return out
