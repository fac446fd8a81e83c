"""Grammar engines for structured output, measured on the SmolLM2 vocabulary (49152 tokens).

For each engine that imports (llguidance, xgrammar): the one-off tokenizer set-up, the per-request
compile of a JSON schema, the time of one token mask along real tokenized documents (the
unconstrained step a plain decode pays), and the time per node of a draft-tree walk (advance one
token, compute its mask, roll back: what speculation pays per draft node). Correctness: every token
of the valid documents must be allowed by the mask before it, EOS must be allowed after the
document, and each invalid document must be refused at some token.

Prints one summary line and writes JSON to --out. xgrammar needs ``transformers`` (it wraps the
tokenizer in a ``PreTrainedTokenizerFast``); run it from an environment that has both:
    python3 bench/grammar_mask.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, write_report  # noqa: E402
from corpus_service.engine.tokenizer import load_tokenizer  # noqa: E402

# A JSONSchemaBench-like schema: nesting, enums, arrays, numbers, optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["id", "name", "role", "active"],
    "additionalProperties": False,
}
VALID = [
    {"id": 1, "name": "Ada Lovelace", "role": "admin", "active": True},
    {"id": 42, "name": "Bob", "email": "bob@example.com", "role": "viewer", "active": False, "score": -3.25,
     "tags": ["a", "b c", "\u00e9t\u00e9"], "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}},
    {"id": 7, "name": "Chen Wei", "role": "editor", "active": True, "score": 1e-05, "tags": [],
     "address": {"city": "Z\u00fcrich"}},
    {"id": 123456, "name": "Dana \"D\" O'Neil", "email": "d@x.org", "role": "admin", "active": True,
     "score": 99.5, "tags": ["x", "y", "z", "w"], "address": {"street": "Rue de la Paix 5", "city": "Paris",
                                                               "zip": "75002"}},
]
INVALID = [
    {"id": 1, "name": "Ada", "role": "owner", "active": True},  # not in the enum
    {"id": -1, "name": "Ada", "role": "admin", "active": True},  # below the minimum
    {"id": 1, "name": "Ada", "role": "admin", "active": True, "extra": 1},  # additionalProperties
    {"id": 1, "name": "Ada", "role": "admin", "active": True, "address": {"city": "X", "zip": "1234a"}},  # pattern
]


# Compact single-line JSON as json.dumps writes it; \uXXXX escapes allowed (json.dumps writes them).
LLG_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                    "json_allow_general_unicode_escapes": True}


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: int) -> None:
        import llguidance as llg

        self.llg, self.vocab, self.eos = llg, vocab, eos
        self.version = getattr(llg, "__version__", "?")
        self.tokenizer = llg.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=[eos])
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=LLG_JSON_OPTIONS)
        m = self.llg.LLMatcher(self.tokenizer, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m, out: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, m, t: int) -> bool:
        return m.try_consume_tokens([t]) == 1

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: int) -> None:
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.torch, self.vocab = xgr, torch, vocab
        from importlib.metadata import version

        self.version = version("xgrammar")
        hf = PreTrainedTokenizerFast(tokenizer_object=tok)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict):
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.xgr.GrammarMatcher(cg, max_rollback_tokens=64)

    def mask(self, m, out: np.ndarray) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(out.view(np.int32)).view(1, -1))

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


def allowed(mask: np.ndarray, t: int) -> bool:
    return bool((int(mask[t >> 5]) >> (t & 31)) & 1)


def measure(engine, docs: list[list[int]], bad_docs: list[list[int]], eos: int, depth: int) -> dict:
    out = np.zeros(engine.words, dtype=np.uint32)
    compile_s, mask_s, node_s, violations, eos_ok = [], [], [], 0, 0
    for ids in docs:
        t = time.perf_counter()
        m = engine.compile(SCHEMA)
        compile_s.append(time.perf_counter() - t)
        for tok in ids:
            t = time.perf_counter()
            engine.mask(m, out)
            mask_s.append(time.perf_counter() - t)
            violations += not allowed(out, tok)
            if not engine.consume(m, tok):
                violations += 1
                break
        engine.mask(m, out)
        eos_ok += allowed(out, eos)
        # Tree walk: from each position, a chain of `depth` real next tokens (mask at every node), rolled back.
        m = engine.compile(SCHEMA)
        for i in range(len(ids) - depth):
            t = time.perf_counter()
            n = 0
            for tok in ids[i:i + depth]:
                if not engine.consume(m, tok):  # a violation (counted above): walk what was accepted
                    break
                engine.mask(m, out)
                n += 1
            if n:
                engine.rollback(m, n)
                node_s.append((time.perf_counter() - t) / n)
            if not engine.consume(m, ids[i]):
                break
    refused = 0
    for ids in bad_docs:
        m = engine.compile(SCHEMA)
        refused += not all(engine.consume(m, tok) for tok in ids)

    mask, node = percentiles(mask_s, "us", scale=1e6), percentiles(node_s, "us", scale=1e6)
    return {"version": engine.version, "masks": len(mask_s), "compile_ms_mean": round(1e3 * statistics.mean(compile_s), 3),
            "mask_us_mean": mask.get("mean_us"), "mask_us_p50": mask.get("p50_us"), "mask_us_p99": mask.get("p99_us"),
            "tree_node_us_mean": node.get("mean_us"), "tree_node_us_p50": node.get("p50_us"),
            "tree_node_us_p99": node.get("p99_us"),
            "violations": violations, "eos_allowed_after_doc": f"{eos_ok}/{len(docs)}",
            "invalid_refused": f"{refused}/{len(bad_docs)}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="smollm2", help="'smollm2', a .gguf or a tokenizer.json")
    p.add_argument("--eos", type=int, default=2, help="EOS id (SmolLM2's <|im_end|>)")
    p.add_argument("--repeats", type=int, default=5, help="passes over the documents")
    p.add_argument("--depth", type=int, default=8, help="draft chain depth of the tree walk")
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_mask.json"))
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    enc = [tok.encode(json.dumps(d), add_special_tokens=False).ids for d in VALID]
    bad = [tok.encode(json.dumps(d), add_special_tokens=False).ids for d in INVALID]
    docs = enc * args.repeats
    res: dict = {"vocab": vocab, "doc_tokens": sum(map(len, enc)), "repeats": args.repeats, "engines": {}}
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        cls = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name]
        try:
            t = time.perf_counter()
            engine = cls(tok, vocab, args.eos)
            setup = time.perf_counter() - t
        except ImportError as e:
            res["engines"][name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        r = measure(engine, docs, bad, args.eos, args.depth)
        res["engines"][name] = {"setup_s": round(setup, 3), **r}
    e = res["engines"]
    summary = {n: {k: v[k] for k in ("mask_us_p50", "mask_us_mean", "tree_node_us_p50", "tree_node_us_mean",
                                       "compile_ms_mean", "violations", "invalid_refused") if k in v} or v
               for n, v in e.items()}
    if all("mask_us_mean" in e.get(n, {}) for n in ("llguidance", "xgrammar")):  # same-run ratios (p50: robust to a busy host)
        for k in ("mask_us_p50", "mask_us_mean", "tree_node_us_p50", "tree_node_us_mean"):
            summary[f"xgrammar_over_llguidance_{k}"] = round(e["xgrammar"][k] / e["llguidance"][k], 3)
    write_report(args.out, res, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
