"""SharedNgramCorpus: what SGLang's NGRAM worker gets as ``NgramCorpus`` once the plugin is loaded.

The same constructor (SGLang 0.5.23's arguments and defaults), methods, argument shapes and returns
as SGLang's own class (``compat.py`` checks them before the plugin hooks anything), drafting from
and feeding the shared corpus named by ``NGRAM_CORPUS_TARGET`` / ``NGRAM_CORPUS_NAMESPACE``:

- ``batch_get`` returns int64 ``[n * draft_token_num]`` drafts and int64 ``[n * K * K]`` ancestor
  masks, as SGLang's does, padded the same way when nothing matches;
- TP rank 0 alone talks to the corpus and broadcasts each step's drafts (``tp_sync.py``);
- the corpus away (at start or mid-run): the step drafts from the in-process engine
  (``corpus_service.NgramCorpus``, fed by every ``batch_put`` so it is warm), said once per outage
  (``corpus_service.client.health.CorpusHealth``), and the corpus is asked again every
  ``NGRAM_CORPUS_RETRY_SECONDS``: back on it within that long of its return;
- ``reset`` (SGLang's flush_cache) resets this replica's state, not the namespace every replica shares.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.health import CorpusHealth, Note
from corpus_service.client.request_log import token_array
from corpus_service.client.sglang import RemoteNgramCorpus
from corpus_service.engine.corpus import NgramCorpus as LocalCorpus
from corpus_service.integrations.settings import IntegrationSettings
from corpus_service.integrations.sglang.namespace_check import check_model, check_served, reachable_namespaces
from corpus_service.integrations.sglang.tp_sync import TpSync, sglang_tp_group
from corpus_service.protocol.status import CorpusError

log = logging.getLogger("corpus_service.integrations.sglang")

MAX_PROMPT_KEYS = 1 << 16  # live requests' prompt keys kept (a bound: SGLang's batches are far smaller)


def prompt_key_of(prompt_ids: Sequence[int]) -> str:
    """The prompt history key of a prompt: its token ids' digest, so the samples of one prompt (n > 1,
    a GRPO group, a repeated question) share one history across every replica of a namespace."""
    return "sglang-prompt:" + hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


def _note(e: BaseException) -> Note:
    code = e.code.name if isinstance(e, CorpusError) else ""
    return Note(code, f"{type(e).__name__}: {e}")


class SharedNgramCorpus:
    """SGLang's ``NgramCorpus`` over the shared corpus service (see the module's docstring)."""

    settings_error: str = ""  # set by the plugin when NGRAM_CORPUS_* is unusable: the constructor raises it

    def __init__(self, max_trie_depth=18, min_bfs_breadth=1, max_bfs_breadth=8, draft_token_num=8, match_type="BFS",
                 capacity=1000000, external_sam_budget=0, external_corpus_max_tokens=10000000) -> None:
        if self.settings_error:
            raise ValueError(self.settings_error)
        settings = IntegrationSettings.from_env()
        if settings is None:
            raise ValueError("NGRAM_CORPUS_TARGET: not set; the shared corpus needs the corpus' host:port")
        if isinstance(external_corpus_max_tokens, bool) or not isinstance(external_corpus_max_tokens, int) \
                or external_corpus_max_tokens < 0:
            raise ValueError(f"external_corpus_max_tokens: expected an int >= 0, got {external_corpus_max_tokens!r}")
        self.settings = settings
        self.draft_token_num = draft_token_num
        self.external_corpus_max_tokens = external_corpus_max_tokens
        self._tp = TpSync(sglang_tp_group())
        # The fallback: SGLang's arguments as SGLang passed them (its match_type, capacity, budget).
        self._local = LocalCorpus(draft_token_num=draft_token_num, match_type=match_type, capacity=capacity,
                                  max_trie_depth=max_trie_depth, min_bfs_breadth=min_bfs_breadth,
                                  max_bfs_breadth=max_bfs_breadth, external_sam_budget=external_sam_budget,
                                  external_corpus_max_tokens=external_corpus_max_tokens) if self._tp.leader else None
        # The client's circuit breaker stays open no longer than the retry period: the replica is back
        # on the corpus within NGRAM_CORPUS_RETRY_SECONDS of its return.
        self._remote = RemoteNgramCorpus(settings.target, settings.namespace, draft_token_num=draft_token_num,
                                         timeout=settings.timeout,
                                         breaker=CircuitBreaker(cooldown_s=settings.retry_seconds))
        self.health = CorpusHealth(settings.target, settings.namespace)
        self._served: dict[str, dict] | None = None
        self._model: tuple | None = None  # (vocab_size, tokenizer) to check once an unreachable corpus answers
        self._last_try = 0.0
        self._prompt_keys: OrderedDict[str, str] = OrderedDict()
        self._seen: set[str] = set()  # live requests drafted since the last reset (reset erases them on the service)
        self.steps_remote = self.steps_local = 0
        self._connect()

    # ------------------------------------------------------------------ start-up and health

    def _connect(self) -> None:
        served = reachable_namespaces(self._remote, self.settings.connect_timeout)
        if served is None:
            self.health.failure(Note("UNAVAILABLE", f"not reachable at start (NGRAM_CORPUS_CONNECT_TIMEOUT {self.settings.connect_timeout:g} s)"))
            self.health.remote_drafting = False
            self._last_try = time.monotonic()
            return
        check_served(self.settings.target, self.settings.namespace, served)
        self._served = served
        self.health.namespace_state, self.health.remote_drafting = "ok", True
        if self._tp.leader:
            log.info("ngram_corpus: drafting from the shared corpus at %s, namespace %r (draft_token_num %d, TP %d)",
                     self.settings.target, self.settings.namespace, self.draft_token_num, self._tp.world_size)

    def check_model(self, vocab_size: int, tokenizer=None) -> str:
        """The namespace against the model (its vocabulary size, its tokenizer's probe ids); ValueError on
        a mismatch. A corpus not reached at start is asked now; still away: checked when it answers."""
        if self._served is None:
            self._served = reachable_namespaces(self._remote, self.settings.connect_timeout)
        if self._served is None:
            self._model = (vocab_size, tokenizer)
            return "corpus unreachable: the namespace is checked when it answers"
        note = check_model(self.settings.target, self.settings.namespace, self._served, vocab_size, tokenizer)
        self.health.namespace_note = note
        return note

    def _remote_usable(self) -> bool:
        """Ask the corpus this step? Always while it answers; while it is away, once per retry period
        (each try costs at most NGRAM_CORPUS_TIMEOUT), so the replica is back within that period."""
        if self.health.namespace_state == "mismatch":
            return False
        if not self.health.unreachable and self._served is not None:
            return True
        now = time.monotonic()
        if now - self._last_try < self.settings.retry_seconds:
            return False
        self._last_try = now
        if self._served is None:  # unreachable since start: the namespace check comes first
            try:
                served = reachable_namespaces(self._remote, self.settings.timeout * 20)
                if served is None:
                    return False
                check_served(self.settings.target, self.settings.namespace, served)
                self._served = served
                if self._model is not None:
                    check_model(self.settings.target, self.settings.namespace, served, *self._model)
            except ValueError as e:  # wrong namespace found mid-run: local drafting for good, said once
                self.health.namespace_state, self.health.namespace_note = "mismatch", str(e)
                log.error("ngram_corpus: %s; drafting locally until SGLang restarts", e)
                return False
            self.health.namespace_state = "ok"
        return True

    def _failed(self, e: BaseException) -> None:
        self.health.failure(_note(e))
        self._last_try = time.monotonic()

    def stats(self) -> dict:
        """The plugin's counters and the corpus' state (outages, steps drafted remotely and locally)."""
        return {**self.health.snapshot(), "steps_remote": self.steps_remote, "steps_local": self.steps_local,
                "tp_rank": self._tp.rank, "tp_size": self._tp.world_size}

    # ------------------------------------------------------------------ SGLang's NgramCorpus calls

    def note_prompts(self, requests: Iterable[tuple[str, Sequence[int]]]) -> None:
        """(req_id, prompt ids) of the requests about to draft (the worker hook passes SGLang's
        ``req.rid`` and ``req.origin_input_ids_unpadded``): their prompt keys travel with ``batch_get``."""
        for rid, prompt in requests:
            rid = str(rid)
            if prompt is None:  # SGLang's Req leaves it None until the request is tokenized
                continue
            if rid not in self._prompt_keys and len(prompt):
                self._prompt_keys[rid] = prompt_key_of(prompt)
                if len(self._prompt_keys) > MAX_PROMPT_KEYS:
                    self._prompt_keys.popitem(last=False)

    def batch_get(self, req_ids: list[str], batch_tokens: list[list[int]], total_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        n, k = len(req_ids), self.draft_token_num
        if not (n == len(batch_tokens) == len(total_lens)):
            raise ValueError(f"batch_get: req_ids, batch_tokens and total_lens must have one entry per request, "
                             f"got {n}, {len(batch_tokens)}, {len(total_lens)}")
        if n == 0:  # every rank knows: nothing to ask or send
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if self._tp.world_size > 1:
            # Bad input must fail on every rank alike: one rank raising alone would leave the others
            # waiting in the broadcast.
            for i, w in enumerate(batch_tokens):
                token_array(w, f"batch_tokens[{i}]")
        drafts = mask = None
        if self._tp.leader:
            drafts, mask = self._draft([str(r) for r in req_ids], batch_tokens, total_lens)
        return self._tp.broadcast(drafts, mask, n, k)

    def _draft(self, ids: list[str], windows: list[list[int]], total_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        keys = [self._prompt_keys.get(r) for r in ids]
        keys_arg = keys if any(keys) else None
        self._seen.update(ids)
        if len(self._seen) > MAX_PROMPT_KEYS:  # requests SGLang never erased: bounded, forget half
            self._seen = set(list(self._seen)[len(self._seen) // 2:])
        if self._remote_usable():
            asked = time.monotonic()
            try:
                out = self._remote.batch_get(ids, windows, total_lens, prompt_keys=keys_arg)
                self.health.success(asked)
                self.steps_remote += 1
                return out
            except Exception as e:  # any failure: this step drafts locally (SGLang's step must not fail)
                self._failed(e)
        self.steps_local += 1
        return self._local.batch_get(ids, windows, total_lens, prompt_keys=keys_arg)

    def batch_put(self, batch_tokens: list[list[int]]) -> None:
        if not self._tp.leader:
            return  # rank 0 feeds the corpus once for the replica
        self._local.batch_put(batch_tokens)  # the fallback stays warm
        if self._served is not None and not self.health.unreachable:
            try:
                self._remote.batch_put(batch_tokens)
            except Exception as e:
                self._failed(e)

    def synchronize(self) -> None:
        if not self._tp.leader:
            return
        self._local.synchronize()
        if self._served is not None and not self.health.unreachable:
            try:
                self._remote.synchronize()
            except Exception as e:
                self._failed(e)

    def reset(self) -> None:
        """SGLang's flush_cache: this replica's request state and its local corpus; the shared namespace
        keeps what every replica taught it (an operator resets it: ``ngram-corpus admin``, REST)."""
        self._prompt_keys.clear()
        seen, self._seen = list(self._seen), set()
        if not self._tp.leader:
            return
        self._local.reset()
        if seen and self._served is not None and not self.health.unreachable:
            try:
                self._remote.erase_match_state(seen)
            except Exception as e:
                self._failed(e)

    def erase_match_state(self, req_ids: list[str]) -> None:
        ids = [str(r) for r in req_ids]
        for rid in ids:
            self._prompt_keys.pop(rid, None)
            self._seen.discard(rid)
        if not self._tp.leader or not ids:
            return
        self._local.erase_match_state(ids)
        if self._served is not None and not self.health.unreachable:
            try:  # on the service, a request's output joins its prompt key's history here
                self._remote.erase_match_state(ids)
            except Exception as e:
                self._failed(e)

    @property
    def remaining_token_budget(self) -> int:
        """SGLang's ``external_corpus_max_tokens`` honoured fleet-wide: minus every external corpus
        the namespace holds, whichever replica added it (CorpusUnavailable while the corpus is away)."""
        return self.external_corpus_max_tokens - sum(self._remote.list_external_corpora().values())

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int]]) -> int:
        """Into the shared namespace (rank 0), staged until ``commit_external_corpus_load``. Other TP
        ranks only count the tokens, so every rank answers SGLang the same."""
        if not self._tp.leader:
            return sum(len(c) for c in chunks)
        chunks = list(chunks)  # SGLang passes a list; counted before anything is sent
        budget, total = self.remaining_token_budget, sum(len(c) for c in chunks)
        if total > budget:
            raise ValueError(f"External ngram corpus of {total} tokens exceeds the remaining token budget ({budget}) "
                             f"of namespace '{self.settings.namespace}' (external_corpus_max_tokens "
                             f"{self.external_corpus_max_tokens}, shared by every replica).")
        return self._remote.load_external_corpus_named(str(corpus_id), chunks)

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        if self._tp.leader:
            self._remote.commit_external_corpus_load(str(corpus_id), loaded_token_count)

    def remove_external_corpus(self, corpus_id: str) -> None:
        if self._tp.leader:
            self._remote.remove_external_corpus(str(corpus_id))

    def list_external_corpora(self) -> dict[str, int]:
        return self._remote.list_external_corpora()

    def close(self) -> None:
        self._remote.close()


__all__ = ["SharedNgramCorpus", "prompt_key_of"]
