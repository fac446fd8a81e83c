"""Policy-version announcements and prompt-history rollouts, as one process or as a replica.

Alone, the engine takes both directly. Replicated (``--log``), both go through the commit log so
that every replica applies the same history in stream order: a finished request's rollout is a
``["h", ...]`` event (published by the replica whose engine held the request, whose own engine does
not add it: its requests start unlearned), and an announcement a ``["v", NS, V]`` marker, applied like
a reset. gRPC ``AnnouncePolicyVersion`` and REST ``POST /v1/namespaces/{ns}/policy-version`` both call
``announce``, which refuses a jump of more than ``--max-policy-version-step`` past the current version
(versions never go back: one announcement of 2**62 - 1 would otherwise fix the namespace's version for
good, snapshots included). Persistence is unchanged: the version is a namespace's state as before.
"""

from __future__ import annotations

import logging

from corpus_service.engine.corpus import NgramCorpus
from corpus_service.engine.prompt_keys import check_policy_version
from corpus_service.exceptions import StalePolicyVersionError
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service")
# Read-your-writes for an announcement on a replica: the marker is applied here before the answer.
ANNOUNCE_VISIBLE_S = 10.0


async def announce(state: ServiceState, namespace: str, version: object) -> int:
    """Moves ``namespace``'s policy version forward to ``version``; returns it. ValueError for a
    bad version, StalePolicyVersionError for one older than the current, KeyError for an unknown
    namespace."""
    corpus = state.corpus(namespace)
    v = check_policy_version(version, "version")
    if v < 0:
        raise ValueError("version: expected a non-negative int")
    current, step = corpus.policy_version(), state.config.max_policy_version_step
    if v - current > step:
        raise ValueError(f"version: {v} is {v - current} ahead of the namespace's current {current}; one announcement "
                         f"moves it at most {step} forward (--max-policy-version-step)")
    if state.replica is None:
        return await state.run(corpus.announce_policy_version, v)
    if v < current:  # checked here; replicas apply the log's markers as max(current, v)
        raise StalePolicyVersionError(f"policy version {v} is older than the namespace's current {current} "
                                      f"(versions only move forward)")
    if v > current:
        state.replica.publisher.add_marker(["v", namespace, v])
        await state.replica.wait_visible(ANNOUNCE_VISIBLE_S)
    return max(v, corpus.policy_version())


def publish_rollout(state: ServiceState, namespace: str, corpus: NgramCorpus, rid: str) -> None:
    """Replicated: queues the rollout of live request ``rid`` (finished next) for the commit log.
    Like a learned chunk, a rollout the full buffer refuses is dropped and counted by the publisher."""
    r = corpus.rollout(rid)
    if r is not None:
        state.replica.publisher.add_rollout(namespace, r.prompt_key, r.policy_version, r.tokens, r.output)
