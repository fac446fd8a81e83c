"""Fixtures of the corpus service tests (real server processes)."""

from tests.corpus_service.service_fixtures import server  # noqa: F401 - a pytest fixture
