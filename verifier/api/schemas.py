"""Request bodies of the OpenAI-compatible routes (extensions: top_k, ignore_eos, speculate,
repetition_penalty, min_tokens, stop_token_ids, regex, ebnf, prompt_key, policy_version).

Nothing a request asks for is dropped silently: a field that is neither an OpenAI field implemented
here nor an extension answers 400 (``extra="forbid"``), and so does an OpenAI field this server does
not implement (``UNSUPPORTED``: tools, logit_bias, ...) unless its value asks for nothing (null,
false, empty, or a listed no-op such as ``tool_choice: "none"``)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corpus_service import check_prompt_key

from ..step.sampling import MAX_TOP_LOGPROBS, SamplingParams
from ..step.structured_spec import from_openai

MAX_SAMPLES = 16  # n and best_of: samples of one prompt decoded together
MAX_POLICY_VERSION = (1 << 62) - 1  # the corpus' bound (corpus_service/engine/prompt_keys.py)
# Counts a request may ask for (tokens, top_k, token ids): any int in JSON parses, but the engine's
# tensors hold int64 and its C++ int32 (an int past them was a 500 "Overflow when unpacking long
# long"); the model's own limits (vocabulary, --max-len) are checked where they are known (app.py).
MAX_COUNT = (1 << 31) - 1
MAX_STOP_TOKEN_IDS = 256
# Every schema is strict: JSON's true is no 1, 1.0 no int and "5" no number (a client sending them
# has a bug that a silent conversion would hide).
STRICT = ConfigDict(extra="forbid", strict=True)

# OpenAI request fields not implemented here, with why (the 400's message).
UNSUPPORTED_COMMON = {
    "logit_bias": "per-token logit biases are not applied",
    "store": "completions are not stored",
    "metadata": "completions are not stored",
    "service_tier": "there are no service tiers",
}
UNSUPPORTED_CHAT = {
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "audio": "the output is text only",
    "modalities": "the output is text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the model has no reasoning settings",
    "verbosity": "the model has no verbosity setting",
    "web_search_options": "there is no web search",
}
UNSUPPORTED_COMPLETIONS = {
    "suffix": "insertion (a suffix after the completion) is not implemented",
    "echo": "the prompt is not echoed",
}
# Values of an unsupported field that ask for what the server does anyway.
_NO_OP = {"tool_choice": ("none",), "modalities": (["text"],), "service_tier": ("auto", "default")}


def no_op_value(name: str, value) -> bool:
    """Whether ``value`` of the unsupported field ``name`` asks for nothing (accepted, then dropped)."""
    return value is None or value is False or value in ("", [], {}) or value in _NO_OP.get(name, ())


def unsupported_fields(schema: type[BaseModel]) -> dict[str, str]:
    return getattr(schema, "UNSUPPORTED", {})


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Common(BaseModel):
    model_config = STRICT

    # Accepted and unused: identifiers and cache hints that change nothing in the output.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_COUNT)  # (larger than the vocabulary: no truncation)
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False
    speculate: bool = True
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_COUNT)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None = Field(default=None,
                                                                                  max_length=MAX_STOP_TOKEN_IDS)
    # Structured output (verifier/step/structured_spec.py): OpenAI's response_format, or SGLang's regex / ebnf.
    response_format: dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    # RL rollouts (the corpus' prompt history): what the request is a sample of, so that the corpus
    # drafts from the key's earlier rollouts and from its live siblings on any replica (default: a
    # hash of the prompt ids), and the policy version sampling it (default: the namespace's current).
    prompt_key: str | None = None
    policy_version: int | None = Field(default=None, ge=0, le=MAX_POLICY_VERSION)

    @field_validator("prompt_key")
    @classmethod
    def _prompt_key(cls, key: str | None) -> str | None:
        try:  # the corpus' rule: 1-256 characters, no control characters
            return check_prompt_key(key)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("prompt_key: ")) from None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop,
                              ignore_eos=self.ignore_eos, speculate=self.speculate,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=self.top_logprob_count(),
                              grammar=from_openai(self.response_format, self.regex, self.ebnf))

    def top_logprob_count(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        return None

    def samples(self) -> int:
        """How many samples to decode (n, or best_of when that is larger)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    UNSUPPORTED: ClassVar[dict[str, str]] = {**UNSUPPORTED_COMMON, **UNSUPPORTED_COMPLETIONS}

    prompt: str | list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)  # the n best by cumulative logprob

    def top_logprob_count(self) -> int | None:
        return self.logprobs

    def samples(self) -> int:
        if self.best_of is None:
            return self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream (the best samples are known only at the end)")
        return self.best_of


class ChatMessage(BaseModel):
    """A message as the chat template sees it: its role and its text. OpenAI's content parts are
    taken where they are text; ``developer`` is OpenAI's newer name for ``system``. Fields the
    template cannot show (``name``, ``tool_calls``, ``tool_call_id``) answer 400."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict]) -> str:
        if isinstance(content, str):
            return content
        texts = []
        for i, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"part {i}: only text parts {{\"type\": \"text\", \"text\": \"...\"}} are "
                                 f"supported, got {str(part)[:80]}")
            texts.append(part["text"])
        return "".join(texts)

    def for_template(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_Common):
    UNSUPPORTED: ClassVar[dict[str, str]] = {**UNSUPPORTED_COMMON, **UNSUPPORTED_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        elif self.max_completion_tokens not in (None, self.max_tokens):
            raise ValueError(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                             "differ: give one")
        return super().sampling(default_max_tokens)
