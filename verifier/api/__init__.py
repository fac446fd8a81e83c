"""OpenAI-compatible HTTP API of the verifier (FastAPI)."""

from .app import create_app

__all__ = ["create_app"]
