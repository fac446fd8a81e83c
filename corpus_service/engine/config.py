"""CorpusConfig: every knob of one namespace's corpus engine, validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from corpus_service import _native

MODES = {"score": _native.DraftMode.SCORE, "prob": _native.DraftMode.PROB, "bfs": _native.DraftMode.BFS}
MAX_BUDGET = 1024


def worst_case_bytes_per_token(num_orders: int) -> float:
    """Upper bound of the learned corpus' bytes per stored token, used to turn the byte bound into a
    token bound that is never exceeded: 4 B token + 4 B chain link per order, times 1.25 for storage
    growth and 1.25 for the evicted prefix awaiting compaction; plus at most 4 B of head slots per
    order (slots never outnumber stored tokens)."""
    return 1.25 * 1.25 * (4 + 4 * num_orders) + 4 * num_orders


def worst_case_history_bytes_per_token(num_orders: int) -> float:
    """Upper bound of the prompt history's bytes per charged token (csrc/prompt_history.h): a key's
    index stores 4 B per token and 4 B per order, times 1.25 for storage growth and 1.25 for an
    evicted prefix awaiting compaction, plus at most 4 B of head slots per order (slots never
    outnumber a key's charge: a key is charged at least 256 tokens, and rebuilt when evictions leave
    its tables oversized), plus 11 B for each rollout's record, the key and slack. 48 with the
    default three own_orders."""
    return 1.25 * 1.25 * (4 + 4 * num_orders) + 4 * num_orders + 11


def _check_orders(name: str, orders: tuple[int, ...]) -> None:
    if not orders or len(orders) > 8:
        raise ValueError(f"{name}: expected 1..8 n-gram orders, got {len(orders)}")
    if len(set(orders)) != len(orders) or any(not 1 <= int(o) <= 32 for o in orders):
        raise ValueError(f"{name}: orders must be distinct ints in [1, 32], got {list(orders)}")


@dataclass(slots=True)
class CorpusConfig:
    """Configuration of one corpus namespace.

    Drafting: candidates are earlier occurrences of the context's tail in each source; each votes for
    its continuation with weight ``source_weight * min(match_len + depth, match_cap) ** alpha``;
    ``P(child | node) = votes(child) / (mass(node) + lambda_)``; the ``budget`` nodes with the highest
    path probability form the draft tree (see ``csrc/draft_tree.h``).
    """

    # "score" (ours; also the SGLang drop-in's, whatever match_type it is given), "prob" (SGLang's PROB
    # ordering: frequency), "bfs" (SGLang's BFS ordering: recency); the last two order this engine's
    # candidates (NgramCorpus(..., sglang_ordering=True) picks them from match_type).
    mode: str = "score"
    # Orders above 8 found no extra candidates on the dev traces (long matches are measured by
    # verification, not by the key), and each order costs 4-8 B per token and a table write.
    own_orders: tuple[int, ...] = (1, 3, 8)  # (1, 2, 4) and (1, 2, 4, 8) drafted the same
    learned_orders: tuple[int, ...] = (1, 2, 4, 8)
    external_orders: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_candidates: int = 32  # occurrences used per source per draft
    max_chain: int = 16  # hash-chain steps per order per lookup
    max_match: int = 64  # longest backward match measured (<= 256)
    max_depth: int = 64  # deepest draft node (<= 256)
    # Once enough_candidates are found, orders below enough_order are not searched: short matches
    # weigh little beside them and cost the longest chain walks (0: search every order).
    enough_candidates: int = 8
    enough_order: int = 4
    alpha: float = 2.0  # match-length exponent for the request's own context
    shared_alpha: float = 2.0  # ... for the learned and external corpora
    lambda_: float = 16.0
    match_cap: int = 32
    depth_gain: float = 1.0  # accepted draft tokens count this much towards the match length
    # Acceptance feedback (csrc/acceptance_model.h): each commit tells which nodes of the request's
    # last draft were accepted; counts per (q, depth) and per (q, token) cell calibrate P(child |
    # parent). Off by default: +0.3-1.0% MAT on the dev traces for ~15% more draft time at B = 15
    # (docs/benchmarks.md); with it on, probabilities (and min_prob) are acceptance probabilities.
    feedback: bool = False
    feedback_prior: float = 32.0  # pseudo-observations of the raw estimate per (q, depth) cell
    feedback_token_prior: float = 16.0  # pseudo-observations per token cell (0 = no token level)
    feedback_window: int = 1 << 15  # a cell's counts halve when its tests reach this (<= 2**15)
    # The rank model (csrc/rank_model.h): an online logistic model of P(child accepted | parent
    # accepted) over per-token and per-(parent token, token) acceptance rates, the request's recent
    # acceptance and the own-context vs shared estimates, learned from every commit of the namespace;
    # nodes are taken best-first by the product of its predictions over the whole candidate tree.
    # False drafts exactly as without it; True takes precedence over `feedback` (whose calibration it
    # contains). +1.3-2.7% MAT on the dev traces for about 2x the draft time at B = 15 (docs/ranking.md).
    rank_model: bool = False
    rank_prior: float = 32.0  # pseudo-observations of q per (q, depth) cell
    rank_token_prior: float = 16.0  # ... of the cell estimate per token cell
    rank_pair_prior: float = 8.0  # ... per (parent token, token) and (grandparent, parent, token) cell
    rank_learning_rate: float = 0.1  # of the weights' AdaGrad steps
    rank_request_decay: float = 0.9  # per step, of the request's recent accepted / expected sums
    rank_window: int = 1 << 15  # a cell's counts halve when its tests reach this (<= 2**15)
    # False: this engine does not learn from its own commits, it queues them for export_rank_delta()
    # (a replica: every replica learns from the deltas in the commit log, this one's included).
    rank_learn_local: bool = True
    # It also learns from the best nodes a draft left out (the commit labels those under an accepted
    # parent: where the budget cut) and takes a pairwise step between each accepted node and its
    # rejected siblings (it orders siblings, where the decision is): +0.3% / +0.8% MAT at B = 7 on
    # the dev traces (docs/ranking.md). 0 turns either off.
    rank_left_out: int = 16  # left-out nodes per draft, best first (<= 256)
    rank_pair_rate: float = 0.3  # of the pairwise steps' AdaGrad
    # lambda_ of the tree's estimates q = vote / (mass + lambda) when the model ranks (it reads them as
    # features; lambda_ stays today's ranking's): 24 drafted +0.1% / -0.4% MAT at B = 7 and +0.2% / +0.2%
    # at B = 15 on the dev traces against 16, +0.0-0.2% on the t07x4 traces (docs/ranking.md).
    rank_lambda: float = 24.0
    # The model ranks (and learns from) the nodes of the first rank_depth levels (0: every level);
    # deeper nodes are ranked as without it. 3 keeps 85-115% of the every-level model's MAT gain on the
    # dev and t07x4 traces, one request at a time and 64 together, for about 0.63x of its extra draft
    # time (2026-12-07, docs/ranking.md "Ranking the first levels").
    rank_depth: int = 3
    min_prob: float = 0.0  # early stop: no node below this path probability (0 = always fill)
    # Candidates weighing less than weak_weight read only weak_depth continuation tokens: their deep
    # nodes never rank within a budget (unchanged MAT on the dev traces, less work per draft).
    weak_weight: float = 1.0
    weak_depth: int = 5
    own_weight: float = 1.0
    learned_weight: float = 0.1  # own-context matches are the more reliable evidence (measured)
    external_weight: float = 1.0
    # Siblings of a request group (the n samples of one prompt), scored like the own context. 0.3-0.7
    # drafted best with 4 samples at temperature 0.7 (bench/acceptance.py --concurrent-samples).
    group_weight: float = 0.5
    learn_prompts: bool = True  # prompts feed the learned corpus too (other requests reuse them)
    learned_max_bytes: int = 2 << 30  # memory bound of the learned corpus (0 = unbounded)
    # How the learned corpus grows (larger hash tables, more storage, compaction after evictions):
    # True builds the grown copy beside the live one while drafts go on, then swaps it in, so no
    # draft waits for it, but the process briefly holds about twice the store's bytes. False grows
    # in place under the lock: no extra memory, drafts wait (a compaction at the default bound
    # moves about 2 GB). docs/history/2026-12.md, "Draft stalls while the learned corpus grows".
    learned_copy_growth: bool = True
    flush_tokens: int = 128  # committed tokens per learned-corpus chunk
    overlap: int = 16  # left context carried into a continuing chunk
    vocab_size: int = 0  # if > 0, token ids must be below it
    request_ttl_s: float = 600.0  # idle requests are dropped (0 = never)
    max_requests: int = 1 << 20
    max_request_tokens: int = 1 << 22  # tokens of one request (prompt + output): bounds its memory
    max_external_tokens: int = 1 << 32
    # Threads drafting one batch's requests (the caller and draft_threads - 1 others), for batches
    # of at least 8 requests per thread; 1 = the calling thread alone. Outputs do not depend on it.
    draft_threads: int = 1
    # Prompt history (csrc/prompt_history.h): each prompt key's finished rollouts, a drafting source
    # weighted per policy-version age. Bounded in total (0 = no history; least recently written keys
    # go first; at most worst_case_history_bytes_per_token() bytes per charged token, so 10,000
    # prompts x 8 samples x 300 tokens fit in 1.23 GB), per key (rollouts, tokens), and by age.
    history_max_bytes: int = 3 << 29  # 1.5 GiB
    history_max_rollouts: int = 64  # per key; the oldest go first
    history_max_key_tokens: int = 1 << 15  # stored tokens per key
    # Rollouts this many policy versions older than their key's newest one (or the announced
    # version) are dropped; 0 keeps every version.
    history_max_age: int = 4
    history_context: int = 16  # prompt tail tokens stored ahead of each output (drafts the first tokens)
    history_weight: float = 1.0  # source weight of a key's rollouts, times the learned multipliers
    # Learn the sibling and per-age history multipliers from what the verifier commits (SourceWeights
    # in csrc/prompt_history.h); source_window tested nodes of a class per update.
    learn_source_weights: bool = True
    source_window: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {sorted(MODES)}, got {self.mode!r}")
        for name in ("own_orders", "learned_orders", "external_orders"):
            value = tuple(int(o) for o in getattr(self, name))
            _check_orders(name, value)
            setattr(self, name, value)
        bounds = {
            "max_candidates": (1, 1024),
            "max_chain": (1, 1 << 20),
            "max_match": (1, 256),
            "max_depth": (1, 256),
            "weak_depth": (1, 256),
            "enough_candidates": (0, 1024),
            "enough_order": (1, 32),
            "match_cap": (1, 1 << 16),
            "flush_tokens": (1, 1 << 24),
            "overlap": (0, 256),
            "max_requests": (1, 1 << 30),
            "max_request_tokens": (1, 1 << 31),
            "feedback_window": (2, 1 << 15),
            "rank_window": (2, 1 << 15),
            "rank_left_out": (0, 256),
            "rank_depth": (0, 64),
            "draft_threads": (1, 64),
            "history_max_rollouts": (1, 1 << 16),
            "history_max_key_tokens": (1024, 1 << 30),
            "history_max_age": (0, 1 << 30),
            "history_context": (0, 256),
            "source_window": (1, 1 << 20),
        }
        for name, (lo, hi) in bounds.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")
        for name in ("feedback", "learned_copy_growth", "learn_source_weights", "rank_model", "rank_learn_local"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("rank_learning_rate", "rank_request_decay", "rank_pair_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}: expected a number in [0, 1], got {v!r}")
        for name in ("rank_prior", "rank_token_prior", "rank_pair_prior", "rank_lambda", "feedback_prior", "feedback_token_prior", "alpha", "shared_alpha", "lambda_", "depth_gain", "weak_weight", "own_weight", "learned_weight", "external_weight", "group_weight", "history_weight", "request_ttl_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v != v or v == float("inf"):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob: expected a probability in [0, 1], got {self.min_prob!r}")
        for name in ("learned_max_bytes", "vocab_size", "max_external_tokens", "history_max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if 0 < self.learned_max_bytes < self.bytes_per_token() * 1024:
            raise ValueError(
                f"learned_max_bytes: {self.learned_max_bytes} is too small to hold 1024 tokens "
                f"(~{self.bytes_per_token()} B per token); use 0 for unbounded"
            )

        if 0 < self.history_max_bytes < self.history_bytes_per_token() * 4096:
            raise ValueError(
                f"history_max_bytes: {self.history_max_bytes} is too small to hold 4096 tokens "
                f"(~{self.history_bytes_per_token()} B per token); use 0 for no prompt history"
            )

    def bytes_per_token(self) -> float:
        return worst_case_bytes_per_token(len(self.learned_orders))

    def history_bytes_per_token(self) -> float:
        return worst_case_history_bytes_per_token(len(self.own_orders))

    def replace(self, **changes: Any) -> "CorpusConfig":
        return dataclasses.replace(self, **changes)

    def to_native(self) -> "_native.CorpusConfig":
        c = _native.CorpusConfig()
        c.own_orders = list(self.own_orders)
        c.learned_orders = list(self.learned_orders)
        c.external_orders = list(self.external_orders)
        for name in ("max_candidates", "max_chain", "max_match", "max_depth", "min_prob", "own_weight", "shared_alpha", "weak_weight", "weak_depth",
                     "enough_candidates", "enough_order",
                     "learned_weight", "external_weight", "group_weight", "learn_prompts", "flush_tokens", "overlap",
                     "vocab_size", "request_ttl_s", "max_requests", "max_request_tokens", "max_external_tokens",
                     "draft_threads", "learned_copy_growth", "history_weight", "learn_source_weights",
                     "source_window"):
            setattr(c, name, getattr(self, name))
        h = _native.HistoryConfig()
        h.max_rollouts, h.max_key_tokens = self.history_max_rollouts, self.history_max_key_tokens
        h.max_age, h.context = self.history_max_age, self.history_context
        h.max_charged_tokens = int(self.history_max_bytes / self.history_bytes_per_token()) if self.history_max_bytes else 0
        c.history = h
        c.mode = MODES[self.mode]
        score = _native.ScoreParams()
        score.alpha, score.lambda_, score.match_cap = self.alpha, self.lambda_, self.match_cap
        score.depth_gain = self.depth_gain
        c.score = score
        fb = _native.FeedbackParams()
        fb.enabled, fb.prior, fb.token_prior = self.feedback, self.feedback_prior, self.feedback_token_prior
        fb.window = self.feedback_window
        c.feedback = fb
        rank = _native.RankParams()
        rank.enabled, rank.prior, rank.token_prior = self.rank_model, self.rank_prior, self.rank_token_prior
        rank.pair_prior, rank.learning_rate = self.rank_pair_prior, self.rank_learning_rate
        rank.request_decay, rank.window, rank.learn = self.rank_request_decay, self.rank_window, self.rank_learn_local
        rank.left_out, rank.pair_rate = self.rank_left_out, self.rank_pair_rate
        rank.tree_lambda, rank.max_depth = self.rank_lambda, self.rank_depth
        c.rank = rank
        c.learned_max_tokens = int(self.learned_max_bytes / self.bytes_per_token()) if self.learned_max_bytes else 0
        return c
