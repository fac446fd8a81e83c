"""Shared n-gram/suffix draft corpus for speculative decoding.

The public API of the in-process corpus (with ``corpus_service.client`` for a remote one, the only
modules other packages import): ``NgramCorpus`` is the engine and ``DraftBatch`` its drafts;
``CorpusConfig`` configures it (``MAX_BUDGET``: the most nodes a tree may have); ``Namespaces`` keeps
one engine per tokenizer family (``check_namespace_name``: the rule for their names);
``read_documents`` reads corpus files (.jsonl, .ids or blank-line-separated text) as uploads do;
``check_prompt_key``/``check_policy_version``/``default_prompt_key``: the prompt history's rules;
``BudgetTooLargeError``: a tree larger than the corpus drafts (a smaller budget will do).
"""

from corpus_service.admin.uploads import read_documents
from corpus_service.engine.config import MAX_BUDGET, CorpusConfig
from corpus_service.engine.corpus import DraftBatch, NgramCorpus
from corpus_service.engine.namespaces import Namespaces, check_namespace_name
from corpus_service.engine.prompt_keys import check_policy_version, check_prompt_key, default_prompt_key
from corpus_service.exceptions import BudgetTooLargeError

__all__ = ["MAX_BUDGET", "BudgetTooLargeError", "CorpusConfig", "DraftBatch", "NgramCorpus", "Namespaces",
           "check_namespace_name", "check_policy_version", "check_prompt_key", "default_prompt_key", "read_documents"]
