"""The grammar matcher on draft trees (llguidance, the real SmolLM2 tokenizer; no model): pruning,
per-node masks against a sequential reference, the batched logit mask, and bad grammars."""

import json

import numpy as np
import pytest
import torch

from verifier.engine.request import Request
from verifier.step.grammar import GrammarCompiler, mask_logits
from verifier.step.sampling import SamplingParams
from verifier.step.structured_spec import GrammarSpec, from_openai

EOS = 2  # SmolLM2's <|im_end|>
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from corpus_service.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.get_vocab_size(with_added_tokens=True), (EOS,))


def trie(tok, texts: list[str]):
    """A draft tree (tokens, parents, probs) holding each text's tokens as a path; parents first."""
    tokens, parents, index = [], [], {}
    for text in texts:
        parent = -1
        for t in tok.encode(text, add_special_tokens=False).ids:
            if (parent, t) not in index:
                index[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = index[(parent, t)]
    n = len(tokens)
    return np.array(tokens, np.int64), np.array(parents, np.int64), np.linspace(1.0, 0.5, n).astype(np.float32)


def path(tokens, parents, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(int(tokens[i]))
        i = int(parents[i])
    return out[::-1]


def reference_mask(compiler, spec, prefix: list[int]) -> np.ndarray:
    m = compiler.matcher(spec).m
    assert m.consume_tokens(prefix)
    return np.frombuffer(m.compute_bitmask(), dtype=np.uint32)[:compiler.words]  # it has one spare word


def test_prune_draft_drops_rejected_subtrees_and_masks_match_a_sequential_matcher(tok, compiler):
    spec = GrammarSpec.json_schema(SCHEMA)
    texts = ['{"name": "Al', '{"name": 5}', '{"age": 30, "name"', "hello world", '{"nam', '{"age": "x"']
    tokens, parents, probs = trie(tok, texts)
    g = compiler.matcher(spec)
    committed = tok.encode('', add_special_tokens=False).ids
    t2, p2, pr2 = g.prune_draft(tokens, parents, probs)
    # Every kept node's path is allowed; every dropped node's path is not.
    kept = {tuple(path(t2, p2, i)) for i in range(len(t2))}
    for i in range(len(tokens)):
        seq = path(tokens, parents, i)
        m = compiler.matcher(spec).m
        ok = m.try_consume_tokens(seq) == len(seq)
        assert ok == (tuple(seq) in kept), tok.decode(seq)
    assert len(t2) < len(tokens) and g.pruned_nodes == len(tokens) - len(t2)
    assert all(p < i for i, p in enumerate(p2)) and np.all(np.diff(pr2) <= 0)  # parents first, order kept
    # Node masks: row 0 after the committed tokens, row 1 + j after the path to kept node j.
    out = np.zeros((1 + len(t2), g.words), np.uint32)
    g.fill_tree_masks(t2, p2, out)
    assert np.array_equal(out[0], reference_mask(compiler, spec, committed))
    for j in range(len(t2)):
        assert np.array_equal(out[1 + j], reference_mask(compiler, spec, path(t2, p2, j))), j
    # The walk rolled the matcher back: it still sits at the committed tokens.
    again = np.zeros((1, g.words), np.uint32)
    g.fill_tree_masks(t2[:0], p2[:0], again)
    assert np.array_equal(again[0], out[0])


def test_mask_logits_batches_every_node_and_leaves_free_requests_alone(tok, compiler):
    V = tok.get_vocab_size(with_added_tokens=True)
    spec = GrammarSpec("regex", r"(yes|no)!")
    constrained = Request("a", [1], SamplingParams(grammar=spec))
    constrained.grammar = compiler.matcher(spec)
    free = Request("b", [1], SamplingParams())
    d_tokens, d_parents, d_probs = trie(tok, ["yes!", "no!", "maybe"])
    drafts = [constrained.grammar.prune_draft(d_tokens, d_parents, d_probs), (d_tokens, d_parents, d_probs)]
    assert len(drafts[0][0]) < len(d_tokens) and len(drafts[1][0]) == len(d_tokens)  # "maybe" pruned
    K = 1 + len(d_tokens)
    logits = torch.randn(2, K, V)
    before = logits.clone()
    mask_logits([constrained, free], drafts, logits)
    assert torch.equal(logits[1], before[1])  # no grammar: untouched
    n = len(drafts[0][0])
    assert torch.equal(logits[0, 1 + n:], before[0, 1 + n:])  # padding nodes: untouched
    allowed = torch.isfinite(logits[0, :1 + n])
    starts = {tok.decode([t]) for t in allowed[0].nonzero().flatten().tolist()}
    assert starts and all("yes".startswith(s) or "no".startswith(s) or s in ("yes!", "no!") for s in starts)
    # After "yes!" / "no!" the regex is complete: only EOS stays.
    for j in range(n):
        if tok.decode(path(*drafts[0][:2], j)) in ("yes!", "no!"):
            assert allowed[1 + j].nonzero().flatten().tolist() == [EOS]
    g = constrained.grammar
    assert g.accept(tok.encode("yes!", add_special_tokens=False).ids + [EOS, 5]) == \
        tok.encode("yes!", add_special_tokens=False).ids  # cut where the grammar completed
    assert g.terminated


def test_prefill_shape_and_json_object(tok, compiler):
    spec = from_openai({"type": "json_object"}, None, None)
    req = Request("a", [1], SamplingParams(grammar=spec))
    req.grammar = compiler.matcher(spec)
    logits = torch.zeros(1, tok.get_vocab_size(with_added_tokens=True))
    mask_logits([req], None, logits)
    first = {tok.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert first and all(s.lstrip().startswith("{") or s.strip() == "" for s in first)


@pytest.mark.parametrize("spec,needle", [
    (GrammarSpec("regex", "a(b"), "regex"),
    (GrammarSpec("ebnf", "root ::= foo"), "foo"),
    (GrammarSpec("ebnf", "root ::= ("), "ebnf"),
    (GrammarSpec.json_schema({"type": "wat"}), "wat"),
])
def test_bad_grammars_raise_value_error_with_the_cause(compiler, spec, needle):
    with pytest.raises(ValueError, match=needle):
        compiler.matcher(spec)


@pytest.mark.parametrize("args,needle", [
    (({"type": "json_schema"}, None, None), "json_schema"),
    (({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None, None), "schema"),
    (({"type": "xml"}, None, None), "response_format.type"),
    (({"type": "json_object"}, "a+", None), "at most one"),
    ((None, "a+", "root ::= \"a\""), "at most one"),
    ((None, "", None), "non-empty"),
])
def test_from_openai_refuses_bad_requests(args, needle):
    with pytest.raises(ValueError, match=needle):
        from_openai(*args)


def test_from_openai_kinds():
    assert from_openai({"type": "text"}, None, None) is None
    assert from_openai({"type": "text"}, "a+", None) == GrammarSpec("regex", "a+")
    s = from_openai({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}, None, None)
    assert s.kind == "json_schema" and json.loads(s.source) == SCHEMA
    with pytest.raises(ValueError, match="not valid JSON"):
        GrammarSpec("json_schema", "{nope")
    with pytest.raises(ValueError, match="GrammarSpec"):
        SamplingParams(grammar="a+")
