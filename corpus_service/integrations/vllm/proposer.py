"""vLLM's suffix proposer, drafting from the shared corpus.

``make_proposer_class(SuffixDecodingProposer)`` subclasses vLLM's own class, so the runner's
``isinstance`` checks and its construction (``SuffixDecodingProposer(vllm_config)``) stay as they
are. Its ``__init__`` builds vLLM's own ArcticInference cache (the fallback) and, on the leader
rank of the tensor-parallel group, the corpus bridge. Each ``propose``:

1. reads the batch as vLLM's ``propose`` does (requests with sampled tokens, below max_model_len);
2. the leader feeds the corpus and drafts them in one call (``CorpusBridge.step``), then sends the
   chains, or None when the corpus did not answer, to the other ranks (``broadcast_object`` on
   the TP group's CPU group), so every rank proposes the same drafts;
3. with chains, vLLM's own cache is only fed (kept warm for an outage); without, vLLM's own
   ``propose`` drafts, identically on every rank, as it would without the plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from corpus_service.integrations.settings import IntegrationSettings
from corpus_service.integrations.vllm.bridge import CorpusBridge, StepRequest

log = logging.getLogger("corpus_service.integrations.vllm")


def _tp_group() -> Any | None:
    """vLLM's tensor-parallel group coordinator of this worker; None where vLLM set up no
    distributed state (one rank)."""
    try:
        from vllm.distributed import parallel_state

        return parallel_state.get_tp_group()
    except (AssertionError, ImportError, AttributeError):  # not initialized: one rank
        return None


def make_proposer_class(base: type, settings: IntegrationSettings,
                        tp_group: Callable[[], Any | None] = _tp_group) -> type:
    """The corpus-backed subclass of vLLM's ``SuffixDecodingProposer`` (``base``)."""

    class CorpusSuffixDecodingProposer(base):  # type: ignore[misc, valid-type]
        """vLLM's ``SuffixDecodingProposer`` drafting from the shared corpus (ngram-corpus plugin)."""

        corpus_settings = settings

        def __init__(self, vllm_config: Any) -> None:
            try:
                super().__init__(vllm_config)
            except ImportError as e:  # vLLM's config validation requires arctic-inference; be safe anyway
                log.warning("ngram_corpus: vLLM's own suffix cache is unavailable (%s): no drafts during an outage", e)
                spec = vllm_config.speculative_config
                self.num_speculative_tokens = spec.num_speculative_tokens
                self.max_tree_depth = spec.suffix_decoding_max_tree_depth
                self.max_model_len = vllm_config.model_config.max_model_len
                self.suffix_cache = None
            group = tp_group()
            self.tp = group if group is not None and group.world_size > 1 else None
            self.is_leader = self.tp is None or self.tp.rank_in_group == 0
            self.bridge = CorpusBridge(settings) if self.is_leader else None
            if self.bridge is not None:
                why = self.bridge.check()
                rank = "" if self.tp is None else f" (leader of {self.tp.world_size} TP ranks)"
                if why:
                    log.warning("ngram_corpus: vLLM's suffix proposer drafts from %s/%s%s once it answers; now: %s",
                                settings.target, settings.namespace, rank, why)
                else:
                    log.info("ngram_corpus: vLLM's suffix proposer drafts from %s/%s%s",
                             settings.target, settings.namespace, rank)

        def propose(self, num_speculative_tokens: int, input_batch: Any, sampled_token_ids: list[list[int]],
                    slot_mappings: Any = None) -> list[list[int]]:
            drafts = None
            if self.bridge is not None:
                try:
                    requests, rows = self._step_requests(num_speculative_tokens, input_batch, sampled_token_ids)
                except Exception as e:  # the leader must reach the broadcast below, or the other ranks wait forever
                    requests, rows = None, []
                    self.bridge.note_failure(e)
                chains = None if requests is None else self.bridge.step(requests, frozenset(input_batch.req_id_to_index))
                if chains is not None:
                    drafts = [[] for _ in sampled_token_ids]
                    for row, chain in zip(rows, chains):
                        drafts[row] = chain
            if self.tp is not None:
                drafts = self.tp.broadcast_object(drafts, src=0)
            if drafts is None:
                if self.suffix_cache is None:
                    return [[] for _ in sampled_token_ids]
                return super().propose(num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings)
            self._feed_local(input_batch, sampled_token_ids)
            return drafts

        def _step_requests(self, k: int, input_batch: Any, sampled_token_ids: list[list[int]]
                           ) -> tuple[list[StepRequest], list[int]]:
            """The rows vLLM's ``propose`` drafts, and their row numbers: partial prefills (no
            sampled token) and requests at max_model_len draft nothing and are not fed."""
            requests, rows = [], []
            for i, sampled in enumerate(sampled_token_ids):
                num_tokens = int(input_batch.num_tokens_no_spec[i])
                max_draft = min(k, self.max_model_len - num_tokens - 1)
                if not sampled or max_draft <= 0:
                    continue
                req_id = input_batch.req_ids[i]
                num_prompt = int(input_batch.num_prompt_tokens[input_batch.req_id_to_index[req_id]])
                requests.append(StepRequest(req_id, input_batch.token_ids_cpu[i], num_prompt, num_tokens, max_draft))
                rows.append(i)
            return requests, rows

        def _feed_local(self, input_batch: Any, sampled_token_ids: list[list[int]]) -> None:
            """vLLM's own bookkeeping of its cache (as its ``propose``), without speculating."""
            cache = self.suffix_cache
            if cache is None:
                return
            for i, sampled in enumerate(sampled_token_ids):
                if not sampled or int(input_batch.num_tokens_no_spec[i]) >= self.max_model_len:
                    continue
                req_id = input_batch.req_ids[i]
                if req_id not in cache.active_requests:
                    if req_id in cache.cached_requests:
                        cache.evict_cached_response(req_id)
                    index = input_batch.req_id_to_index[req_id]
                    cache.start_request(req_id, input_batch.token_ids_cpu[index, :input_batch.num_prompt_tokens[index]])
                cache.add_active_response(req_id, sampled)
            for req_id in cache.active_requests - input_batch.req_id_to_index.keys():
                cache.stop_request(req_id)

    return CorpusSuffixDecodingProposer
