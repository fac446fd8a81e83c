"""A small pure-Python model of the corpus engine, used as the oracle in differential tests.

It keeps every document as a plain list and finds candidates by brute force. With caps that do not
bind (large max_chain and max_candidates), the native engine must find exactly these candidates and
assign the same path probabilities (see csrc/draft_tree.h for the math).

Sources: the request's own context, its prompt's history (csrc/prompt_history.h: every request that
names no key is keyed by its prompt ids, and what it generated joins that key's rollouts when it
finishes), the learned corpus and the external corpora. Modelled for one policy version, no groups
and no learned source multipliers (learn_source_weights off), as the differential tests run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Doc:
    tokens: list[int]
    context: int = 0  # leading tokens that are left context only (not indexed)
    next: "Doc | None" = None  # the chunk that continues this one (same request)

    def after(self, p: int) -> list[int]:
        out, d = self.tokens[p + 1:], self.next
        while d is not None:
            out += d.tokens[d.context:]
            d = d.next
        return out


@dataclass
class RefRequest:
    tokens: list[int]
    pending: list[int] = field(default_factory=list)
    last_chunk: Doc | None = None
    chunks: list = field(default_factory=list)  # its own chunks in the learned corpus (not a source for it)
    prompt_len: int = 0


class RefCorpus:
    def __init__(self, *, orders, enough_candidates, enough_order, alpha, shared_alpha, weak_weight, weak_depth, lambda_, match_cap, own_weight, learned_weight, external_weight,
                 max_match, max_depth, flush_tokens, overlap, learn_prompts, mode="score",
                 history_weight=1.0, history_context=16, history_max_rollouts=64):
        self.orders = orders  # source name -> n-gram orders
        self.enough = (enough_candidates, enough_order)
        self.p = dict(alpha=alpha, shared_alpha=shared_alpha, weak_weight=weak_weight, weak_depth=weak_depth, lambda_=lambda_, match_cap=match_cap, max_match=max_match, max_depth=max_depth,
                      flush_tokens=flush_tokens, overlap=overlap, learn_prompts=learn_prompts, mode=mode)
        self.weights = {"own": own_weight, "learned": learned_weight, "external": external_weight, "history": history_weight}
        self.history_context, self.history_max_rollouts = history_context, history_max_rollouts
        self.requests: dict[str, RefRequest] = {}
        self.learned: list[Doc] = []
        self.externals: dict[str, list[Doc]] = {}
        # Prompt key (the prompt ids: the engine's default key is their hash) -> rollouts, oldest first.
        self.history: dict[tuple[int, ...], list[Doc]] = {}

    # ---------------------------------------------------------------- state changes
    def start(self, rid, prompt):
        self.requests[rid] = RefRequest(list(prompt), list(prompt) if self.p["learn_prompts"] else [],
                                        prompt_len=len(prompt))

    def _flush(self, r: RefRequest, min_tokens: int):
        if not r.pending or len(r.pending) < min_tokens:
            return
        before = len(r.tokens) - len(r.pending)
        ctx = min(before, self.p["overlap"])
        doc = Doc(r.tokens[before - ctx:], ctx)
        self.learned.append(doc)
        if r.last_chunk is not None:
            r.last_chunk.next = doc
        r.last_chunk = doc
        r.chunks.append(doc)
        r.pending = []

    def extend(self, rid, toks):
        r = self.requests[rid]
        r.tokens += toks
        r.pending += toks
        self._flush(r, self.p["flush_tokens"])

    def finish(self, rid):
        r = self.requests.pop(rid)
        self._flush(r, 1)
        # A request with output joins its key's history: the prompt's last history_context tokens
        # (indexed like the rest, so the first output tokens can be drafted), then the output.
        if len(r.tokens) > r.prompt_len:
            ctx = min(r.prompt_len, self.history_context)
            rollouts = self.history.setdefault(tuple(r.tokens[:r.prompt_len]), [])
            rollouts.append(Doc(r.tokens[r.prompt_len - ctx:]))
            del rollouts[:-self.history_max_rollouts]  # the oldest go first

    def learned_stream(self) -> list[int]:
        out = []
        for i, d in enumerate(self.learned):
            if i:
                out.append(-(2**31))
            out += d.tokens
        return out

    # ---------------------------------------------------------------- drafting
    def _candidates(self, docs: list[Doc], ctx: list[int], exclude_last: bool, orders: tuple[int, ...]):
        cands = self._all_candidates(docs, ctx, exclude_last)
        # The engine searches orders longest first (uncapped, order k finds exactly the candidates
        # matching >= k tokens) and, once `enough` are found, skips orders below `enough_order`.
        enough, enough_order = self.enough
        kept_min = None
        for k in sorted(orders, reverse=True):
            found = sum(1 for _, m in cands if kept_min is not None and m >= kept_min)
            if enough and found >= enough and k < enough_order:
                break
            kept_min = k
        return [(c, m) for c, m in cands if kept_min is not None and m >= kept_min]

    def _all_candidates(self, docs: list[Doc], ctx: list[int], exclude_last: bool):
        cands = []
        for di, d in enumerate(docs):
            last = len(d.tokens) - (1 if exclude_last else 0)
            for p in range(d.context, last):
                m = 0
                while m < min(len(ctx), self.p["max_match"]) and p - m >= 0 and d.tokens[p - m] == ctx[-1 - m]:
                    m += 1
                if m >= 1:
                    cands.append((d.after(p), m))
        return cands

    def draft_probs(self, rid, budget) -> list[tuple[tuple[int, ...], float]]:
        """All (path, probability) pairs of the merged trie, best first, cut at budget."""
        r = self.requests[rid]
        ctx = r.tokens[-self.p["max_match"]:]
        depth = min(budget, self.p["max_depth"])
        learned = [d for d in self.learned if not any(d is c for c in r.chunks)]
        history = self.history.get(tuple(r.tokens[:r.prompt_len]), [])
        sources = [("own", [Doc(r.tokens)], True), ("history", history, False), ("learned", learned, False)]
        sources += [("external", docs, False) for docs in self.externals.values()]
        vote: dict[tuple, float] = {}
        mass: dict[tuple, float] = {(): 0.0}
        score = self.p["mode"] == "score"
        for name, docs, excl in sources:
            for cont, m in self._candidates(docs, ctx, excl, self.orders[name]):
                # A key's rollouts are scored like the own context (its exponent and orders).
                alpha = self.p["alpha"] if name in ("own", "history") else self.p["shared_alpha"]

                def w(d):
                    return self.weights[name] * min(m + d, self.p["match_cap"]) ** alpha if score else 1.0
                path: tuple = ()
                mass[()] += w(0)
                weak = score and self.weights[name] * min(m, self.p["match_cap"]) ** alpha < self.p["weak_weight"]
                for i, t in enumerate(cont[:min(depth, self.p["weak_depth"]) if weak else depth]):
                    path = path + (t,)
                    vote[path] = vote.get(path, 0.0) + w(i)
                    mass[path] = mass.get(path, 0.0) + w(i + 1)
        lam = self.p["lambda_"] if score else 0.0
        probs: dict[tuple, float] = {}
        for path in sorted(vote, key=len):
            parent = path[:-1]
            denom = mass[parent] + lam
            probs[path] = (probs.get(parent, 1.0) if parent else 1.0) * min(1.0, vote[path] / denom)
        ranked = sorted(probs.items(), key=lambda kv: -kv[1])
        return ranked[:budget]
