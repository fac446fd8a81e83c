"""Offline rollouts: ``LLM(...).generate(prompts, SamplingParams(n=...))`` in process (``llm.py``), the
``generate`` command (``cli.py``) and its prompt files (``prompts.py``)."""

from .llm import LLM, CompletionOutput, RequestOutput, RunSummary, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RunSummary", "SamplingParams"]
