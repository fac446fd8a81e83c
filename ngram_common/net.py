"""Whether a host is loopback: the rule behind the corpus' admin token requirement, its off-loopback
security warnings and plaintext client channels, and the verifier's API key requirement off loopback.

A host name other than ``localhost`` counts as off loopback, whatever it resolves to now: a name can
resolve to another address later (or on another resolver), and the rule must not open a server
that a name only seemed to keep local."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name that is not localhost may resolve to anything
