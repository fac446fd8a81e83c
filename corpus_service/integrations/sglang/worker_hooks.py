"""Hooks on SGLang's NGRAM worker, applied by SGLang's HookRegistry (no SGLang file is edited).

- around ``NGRAMWorker.__init__``: once the worker has built its corpus, the namespace is checked
  against the model (vocabulary size, tokenizer): a mismatch fails start-up with one clear error;
- around ``NGRAMWorker._prepare_draft_tokens``: before each draft, the corpus is told each request's
  prompt (``req.rid``, ``req.origin_input_ids_unpadded``), which ``batch_get`` never carries, so
  requests of one prompt share a prompt history on the service (``SharedNgramCorpus.note_prompts``).

Both only act when the worker's corpus is ours (another plugin may have replaced it)."""

from __future__ import annotations

import logging

from corpus_service.integrations.sglang.compat import WORKER_CLASS
from corpus_service.integrations.sglang.corpus import SharedNgramCorpus

log = logging.getLogger("corpus_service.integrations.sglang")


def around_worker_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    corpus = getattr(self, "ngram_corpus", None)
    if isinstance(corpus, SharedNgramCorpus):
        target = getattr(self, "_target_worker", None)
        model_config = getattr(getattr(target, "model_runner", None), "model_config", None)
        vocab_size = getattr(model_config, "vocab_size", None)
        if vocab_size is None:
            log.warning("ngram_corpus: the model's vocabulary size is not visible to the plugin: namespace %r not "
                        "checked against the model", corpus.settings.namespace)
            return
        log.info("ngram_corpus: %s", corpus.check_model(int(vocab_size), getattr(target, "tokenizer", None)))


_prompt_hook_failed = False


def around_prepare_draft_tokens(original, self, batch):
    global _prompt_hook_failed
    corpus = getattr(self, "ngram_corpus", None)
    if isinstance(corpus, SharedNgramCorpus) and not _prompt_hook_failed:
        try:
            corpus.note_prompts((req.rid, getattr(req, "origin_input_ids_unpadded", None)) for req in batch.reqs)
        except Exception as e:  # prompt keys are an optimisation: never a reason to fail SGLang's decode step
            _prompt_hook_failed = True
            log.warning("ngram_corpus: request prompts cannot be read from SGLang's batch (%s: %s): drafting goes on "
                        "without prompt history from this replica", type(e).__name__, e)
    return original(self, batch)


HOOKS = {WORKER_CLASS + ".__init__": around_worker_init,
         WORKER_CLASS + "._prepare_draft_tokens": around_prepare_draft_tokens}
