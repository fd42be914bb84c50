"""Which host names an HTTP server of Arbiter's answers: the check that keeps DNS rebinding out.

A web page the operator opens can make its own name (``attacker.example``) resolve to 127.0.0.1;
the browser then lets the page read whatever answers there, as if it were the page's own. The
request still says ``Host: attacker.example``, so a server that answers only the names it is
reached by (loopback names, addresses, and the names its operator lists) is not read this way:
a rebinding needs a name the attacker controls, never an address literal. The front door
(``arbiter.door.origin``) and a worker's metrics use this.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

LOOPBACK_NAMES = frozenset({"localhost"})
"""The loopback name every server answers, besides loopback addresses."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address or a request's host name) is this machine's loopback only."""
    name = host.strip("[]").lower().removesuffix(".")
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header's (name, port), the name lower-case; None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        name, colon, port_text = value.rpartition(":")
        name, port = (name, port_text) if colon else (value, None)
        if ":" in name:
            return None  # an IPv6 address is written in brackets
    name = name.removesuffix(".")
    if not name or (port is not None and not (port.isdigit() and 0 < int(port) < 65536)):
        return None
    return name, None if port is None else int(port)


def is_address(name: str) -> bool:
    """Whether ``name`` is an IP address literal (not a name someone could point elsewhere)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_names(configured: str) -> set[str]:
    """A comma-separated list of host names, as a set (lower-case, without a trailing dot)."""
    return {n.strip().lower().removesuffix(".") for n in configured.split(",") if n.strip()}


@dataclass(frozen=True)
class HostNames:
    """The host names a server answers."""

    names: frozenset[str]
    any_name: bool
    """``*`` was configured: any name (behind a proxy that checks ``Host`` itself)."""
    addresses: bool
    """Any IP address as a name (a server that listens beyond loopback); loopback addresses always."""

    @classmethod
    def of(cls, configured: str, addresses: bool) -> HostNames:
        """Loopback names, the ``configured`` ones (comma separated; ``*``: any), and, with
        ``addresses``, any IP address."""
        names = host_names(configured)
        return cls(frozenset(LOOPBACK_NAMES | (names - {"*"})), "*" in names, addresses)

    def allows(self, name: str) -> bool:
        """Whether a request sent to host ``name`` is for this server."""
        if self.any_name or name in self.names:
            return True
        return is_address(name) and (self.addresses or is_loopback(name))

    def allows_header(self, header: str) -> bool:
        """Whether a request whose ``Host`` header is ``header`` is for this server."""
        host = split_host(header)
        return host is not None and self.allows(host[0])
