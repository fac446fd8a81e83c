"""Request bodies of the OpenAI-compatible routes (extensions: top_k, ignore_eos, speculate,
repetition_penalty, min_tokens, stop_token_ids, regex, ebnf)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import MAX_TOP_LOGPROBS, SamplingParams
from ..structured_spec import from_openai

MAX_SAMPLES = 16  # n and best_of: samples of one prompt decoded together


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False
    speculate: bool = True
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Structured output (verifier/structured_spec.py): OpenAI's response_format, or SGLang's regex / ebnf.
    response_format: dict | None = None
    regex: str | None = None
    ebnf: str | None = None

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
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = Field(default=False, le=False)  # not supported
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
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max_tokens)
