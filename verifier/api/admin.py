"""Who may change what a verifier serves: ``POST /v1/policy-version`` and ``POST /v1/update-weights``.

Both act for everyone: an announcement moves the corpus namespace's version that every replica
shares (with the verifier's own corpus token, which may carry the corpus' admin role), and an update
replaces the weights that every client is answered with. Reaching the verifier's port, or holding
its API key, is not enough: each route is off unless its flag turns it on (``--allow-policy-version``,
``--allow-weight-updates``) and then needs ``Authorization: Bearer <--admin-key>``, a credential of
its own that ``VerifierConfig`` refuses to be the API key. docs/security.md lists the rules.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .body import ApiError


@dataclass(frozen=True, slots=True)
class AdminAccess:
    key: str = ""  # the admin credential; '' = no admin route answers
    policy_version: bool = False  # POST /v1/policy-version on (--allow-policy-version)

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"AdminAccess(key={'set' if self.key else 'unset'}, policy_version={self.policy_version})"

    def require(self, route: str, enabled: bool, flag: str, authorization: str | None) -> None:
        """ApiError 403 where ``route`` is off (``flag`` turns it on) or no admin key is configured,
        401 where the caller's ``Authorization`` is not the admin key."""
        if not enabled:
            raise ApiError(403, f"{route}: this verifier was started without {flag}", None,
                           f"{route.rsplit('/', 1)[-1].replace('-', '_')}_disabled")
        if not self.key:
            raise ApiError(403, f"{route}: this verifier has no --admin-key", None, "admin_key_unset")
        given = (authorization or "").removeprefix("Bearer ")
        if not (authorization or "").startswith("Bearer ") or not hmac.compare_digest(given.encode(), self.key.encode()):
            raise ApiError(401, f"{route}: needs the verifier's admin key (Authorization: Bearer <--admin-key>; "
                                "the API key is not enough)", None, "admin_key_required")
