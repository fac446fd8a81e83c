"""Structured output under speculation: a grammar matcher per request (llguidance) that prunes the
draft tree and masks the target logits of every tree node.

Why this is exact: node i's logits predict the token after the path root..i, so its mask is the
matcher's allowed set after consuming that path. With every node's logits masked (-inf outside the
set), greedy verification accepts a draft token only if it is the masked argmax, and the bonus
token is the masked argmax: the same tokens plain masked decoding picks. Rejection sampling runs
against the masked target q, so every sampled token is allowed too. Draft nodes the grammar rejects
are removed (with their subtrees) before the forward: they could never be accepted, so verifying
them would only cost compute.

llguidance was picked over xgrammar by ``bench/grammar_mask.py`` (docs/benchmarks.md): it reads
the HF ``tokenizers`` JSON directly (xgrammar needs ``transformers``), compiles a schema in ~2 ms
(xgrammar ~35 ms), and accepts every valid test document (xgrammar 0.2.9 refuses escaped quotes in
strings with a length limit); xgrammar's masks were faster on the CPU.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..engine.request import Request, _finish
from .structured_spec import GrammarSpec

# JSON as json.dumps writes it: one line, ", " and ": ". Free whitespace lets a small model loop on
# newlines forever; \uXXXX escapes are valid JSON and json.dumps writes them, so they stay allowed.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allow_general_unicode_escapes": True}
_ALL = np.uint32(0xFFFFFFFF)
# llguidance's own limits at their defaults, but errors without the parser's state and the grammar
# (verbose errors dump both: an API answer and a request's error must not carry them).
_LIMITS: dict = {"verbose_errors": False}
_LL_TOKENIZERS: dict = {}  # (id(tokenizer), vocab_size, eos_ids) -> (tokenizer, LLTokenizer)
_LL_LOCK = threading.Lock()


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not yet checked: ``GrammarCompiler.matcher`` checks it)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.source))  # GBNF (root ::= ...) or Lark (start: ...)
    except Exception as e:  # the converter's own parse errors
        raise ValueError(f"ebnf: {e}") from None


class GrammarCompiler:
    """Compiles specs into per-request matchers for one tokenizer and model vocabulary. The
    llguidance tokenizer (~0.5 s to build) is made on the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.words = (vocab_size + 31) // 32  # uint32 words of one bitmask row
        self._ll = None

    def _ll_tokenizer(self):
        with _LL_LOCK:
            if self._ll is None:
                from llguidance import LLTokenizer

                key = (id(self.tokenizer), self.vocab_size, self.eos_ids)
                if key not in _LL_TOKENIZERS:  # engines of one model share it (the key's object is kept alive)
                    _LL_TOKENIZERS[key] = (self.tokenizer, LLTokenizer(
                        self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_ids) or None))
                self._ll = _LL_TOKENIZERS[key][1]
            return self._ll

    def warm(self) -> None:
        """Builds the llguidance tokenizer now (the server calls it on a background thread at
        start-up, so the first structured request does not pay ~0.5 s on the API's event loop)."""
        self._ll_tokenizer()

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher":
        """ValueError (with llguidance's message) for a grammar that does not compile."""
        from llguidance import LLMatcher

        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"grammar: expected a GrammarSpec, got {type(spec).__name__}")
        from llguidance import LLParserLimits

        text = grammar_text(spec)
        m = LLMatcher(self._ll_tokenizer(), text, log_level=0, limits=LLParserLimits(**_LIMITS))
        if not m.is_error():
            # llguidance builds lazily: a grammar with no finite output ({"$ref": "#"}, root ::= root) or
            # one past its lexer limits fails at the first mask. Computing it here (it does not advance
            # the matcher) turns that into the request's 400 instead of an empty "stop" or an error later.
            first = np.zeros(self.words, dtype=np.uint32)
            m.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
            if not m.is_error() and not first.any():
                raise ValueError(f"{spec.kind}: the grammar allows no token at all")
        if m.is_error():
            raise ValueError(f"{spec.kind}: the grammar cannot be used: {_short_error(m.get_error())}")
        return GrammarMatcher(m, self.words, self.eos_ids)


class GrammarMatcher:
    """One request's grammar state: advanced by committed tokens, walked (and rolled back) along
    draft trees."""

    def __init__(self, matcher, words: int, eos_ids: tuple[int, ...]) -> None:
        self.m, self.words, self.eos_ids = matcher, words, eos_ids
        self.error: str | None = None
        self.pruned_nodes = 0  # draft nodes removed because the grammar rejects them

    @property
    def terminated(self) -> bool:
        """No token but EOS can follow (the grammar is complete), or the matcher failed."""
        return self.m.is_stopped()

    def accept(self, tokens: list[int]) -> list[int]:
        """Consumes committed tokens; returns them cut after the one that completes the grammar
        (a tree path may carry EOS after it; plain decoding would have stopped there)."""
        out = []
        for t in tokens:
            if self.m.is_stopped():
                break
            if self.m.try_consume_tokens([int(t)]) != 1:  # masks make this impossible: an invariant
                self.error = f"grammar refused committed token {int(t)}: {self.m.get_error() or 'not allowed'}"
                break
            out.append(int(t))
        return out

    def prune_draft(self, tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray):
        """The draft without the nodes the grammar rejects (and their subtrees), order kept."""
        n = len(tokens)
        if n == 0 or self.m.is_stopped():
            return tokens[:0], parents[:0], probs[:0]
        keep = np.zeros(n, dtype=bool)
        children = _children(parents)
        tok = tokens.tolist()

        def walk(node: int) -> None:
            for c in children[node + 1]:
                if self.m.try_consume_tokens([tok[c]]) == 1:
                    keep[c] = True
                    walk(c)
                    self.m.rollback(1)

        walk(-1)
        if keep.all():
            return tokens, parents, probs
        self.pruned_nodes += int(n - keep.sum())
        idx = np.flatnonzero(keep)
        remap = np.full(n, -1, dtype=np.int64)
        remap[idx] = np.arange(len(idx))
        p = parents[idx].astype(np.int64)
        return tokens[idx], np.where(p >= 0, remap[np.maximum(p, 0)], -1), probs[idx]

    def fill_tree_masks(self, tokens: np.ndarray, parents: np.ndarray, out: np.ndarray) -> None:
        """out [>= 1 + n, words] uint32: row 0 the mask after the committed tokens, row 1 + j the
        mask after the path to draft node j (the draft was pruned by ``prune_draft``)."""
        children = _children(parents)
        tok = tokens.tolist()

        def fill(row: int) -> None:
            r = out[row]
            self.m.unsafe_compute_mask_ptr(r.ctypes.data, r.nbytes)
            if not r.any():  # a failed matcher allows nothing: let the request end instead of NaNs
                for e in self.eos_ids:
                    r[e >> 5] |= np.uint32(1 << (e & 31))

        def walk(node: int) -> None:
            fill(node + 1)
            for c in children[node + 1]:
                ok = self.m.try_consume_tokens([tok[c]]) == 1
                assert ok, "draft node not pruned by prune_draft"
                walk(c)
                self.m.rollback(1)

        walk(-1)


def _short_error(err: str | None) -> str:
    """llguidance's message without its placeholder for the verbose dump; "NoExtensionBias" (the
    parser has nowhere to go) said in words."""
    text = " ".join((err or "").replace("<non-verbose/>", " ").split())[:300]
    if text == "NoExtensionBias" or not text:
        return "it has no finite output (e.g. a schema or rule that refers to itself with nothing else allowed)"
    return text


def _children(parents: np.ndarray) -> list[list[int]]:
    """children[p + 1]: the nodes whose parent is p (-1 = the root), in order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p + 1].append(i)
    return out


# ------------------------------------------------------------------ the engine's hooks


@torch.inference_mode()  # the logits are inference tensors (updated in place)
def mask_logits(reqs: list[Request], drafts: list | None, logits: torch.Tensor) -> torch.Tensor:
    """logits [bs, K, V] (or [bs, V] with no drafts): every node of a structured request masked to
    -inf outside its grammar's allowed set, in place, in one masked_fill over [bs * K, V]. The
    matcher walk runs on the CPU while a GPU forward that produced ``logits`` may still run."""
    if all(r.grammar is None for r in reqs):
        return logits
    view = logits if logits.dim() == 3 else logits[:, None]
    bs, K, V = view.shape
    words = next(r.grammar.words for r in reqs if r.grammar is not None)
    bits = np.full((bs, K, words), _ALL, dtype=np.uint32)  # padding rows and free requests: all allowed
    for b, r in enumerate(reqs):
        if r.grammar is not None:
            tokens, parents = (drafts[b][0], drafts[b][1]) if drafts else (np.zeros(0, np.int64), np.zeros(0, np.int64))
            r.grammar.fill_tree_masks(tokens, parents, bits[b])
    packed = torch.from_numpy(bits.view(np.int32)).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed[..., None] >> shifts) & 1).view(bs, K, words * 32)[..., :V]
    view.masked_fill_(allowed == 0, float("-inf"))
    # A row with nothing left (min_tokens masking EOS where the grammar allows only EOS, after the
    # grammar completed on a draft path: never committed) gets EOS back instead of NaN probabilities.
    eos = next(r.grammar.eos_ids for r in reqs if r.grammar is not None)
    if eos:
        dead = torch.isneginf(view).all(-1)
        view[..., eos[0]] = torch.where(dead, torch.zeros_like(view[..., eos[0]]), view[..., eos[0]])
    return logits


def settle(req: Request, tokens: list[int]) -> list[int]:
    """Before committing: the tokens cut at the grammar's end."""
    return tokens if req.grammar is None else req.grammar.accept(tokens)


def finish_if_complete(req: Request, decode) -> None:
    """After committing: a request whose grammar is complete finishes with "stop"."""
    g = req.grammar
    if g is None or req.finished:
        return
    if g.error is not None:
        req.error = g.error
        _finish(req, "error", decode)
    elif g.terminated:
        _finish(req, "stop", decode)
