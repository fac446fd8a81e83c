"""Whether a host is loopback: the rule behind the admin token's requirement, the off-loopback security
warnings and plaintext client channels (a leaf: the server's config and the security modules import it)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name that is not localhost may resolve to anything
