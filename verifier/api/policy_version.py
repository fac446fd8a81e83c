"""``POST /v1/policy-version``: an RL loop says the policy's weights changed (``{"version": V}``).

A request's own ``policy_version`` is all the prompt history needs to weigh its rollouts (by how many
versions apart they are) and to drop a key's rollouts ``history_max_age`` versions older than its
newest; a request without one is sampled by the namespace's current version. Announcing moves that
current version forward, so that requests without a version count as the new policy's and history
of keys not sampled again ages out too. On a verifier drafting from a corpus service the
announcement goes to the service (its admin role: ``--corpus-token`` must carry it), then to this
verifier's in-process mirror; with ``--corpus local`` to the in-process corpus. Off unless the verifier
runs with ``--allow-policy-version``, and then for the ``--admin-key`` only (``admin.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from ..draft.drafter import Drafter
from .body import ApiError
from .schemas import MAX_POLICY_VERSION


# With --corpus local, the step the corpus service allows by default (its --max-policy-version-step):
# versions never go back, so one absurd announcement would fix the in-process corpus' version.
MAX_LOCAL_STEP = 1 << 20


class PolicyVersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(ge=0, le=MAX_POLICY_VERSION)


@dataclass
class PolicyAnnouncer:
    drafter: Drafter | None
    namespace: str = "default"  # the corpus service's namespace (remote drafting)
    token: str | None = None
    tls: str | None = None
    timeout_s: float = 5.0

    def announce(self, version: int) -> dict:
        """The namespace's version after the announcement; ApiError 409 for a version older than
        the current one (versions only move forward), 502 where the corpus service refused or failed."""
        d = self.drafter
        if d is None:
            raise ApiError(409, "policy-version: this verifier has no corpus (--corpus none)", "version")
        if d.target == "local":
            current = d.local.policy_version()
            if version - current > MAX_LOCAL_STEP:
                raise ApiError(400, f"version: {version} is {version - current} ahead of the current {current}; one "
                               f"announcement moves it at most {MAX_LOCAL_STEP} forward", "version", "bad_policy_version")
            try:
                return {"version": d.local.announce_policy_version(version), "corpus": "local"}
            except ValueError as e:
                raise ApiError(409, f"version: {e}", "version", "stale_policy_version") from None
        from corpus_service.client import CorpusClient, CorpusError, CorpusInvalidArgument

        try:
            with CorpusClient(d.target, namespace=self.namespace, timeout=self.timeout_s, token=self.token,
                              tls=self.tls) as client:
                current = client.announce_policy_version(version)
        except CorpusInvalidArgument as e:  # e.g. a jump past the corpus' --max-policy-version-step
            raise ApiError(400, f"version: refused by the corpus: {e}", "version", "bad_policy_version") from None
        except ValueError as e:  # CorpusFailedPrecondition: older than the namespace's version
            raise ApiError(409, f"version: {e}", "version", "stale_policy_version") from None
        except CorpusError as e:
            raise ApiError(502, f"corpus {d.target}: the announcement failed: {type(e).__name__}: {e}") from None
        d.local.advance_policy_version(current)  # the mirror's own history ages alike
        return {"version": current, "corpus": d.target, "namespace": self.namespace}
