"""``flag``: a config field that is also an ``ngram-verifier`` flag (``verifier.config.add_config_flags``
reads its metadata). Its own module so that every component's config (``VerifierConfig``,
``verifier.draft.config.DraftConfig``) declares flags without importing the others."""

from __future__ import annotations

from dataclasses import field


def flag(default, help: str, allowed: str = "", short: str = "", **kw):
    """A config field and its ``serve`` flag's help: what it does (why, where it is not obvious) and
    ``allowed``, the values it takes (add_config_flags adds the env var and the default); ``short``:
    a one-letter alias ("-n")."""
    return field(default=default, metadata={"help": help, "allowed": allowed, "short": short}, **kw)


def nested(cls):
    """A field holding another component's config dataclass: its fields are flags of their own,
    under their own names (``--remote-drafts`` sets ``VerifierConfig.draft.remote_drafts``)."""
    return field(default_factory=cls, metadata={"nested": True})
