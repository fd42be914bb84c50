"""Which requests a door answers, by their ``Host`` and ``Origin``: no web page reads it from a browser.

Theory of operation
-------------------
A page the operator opens can make the browser send requests anywhere, a door included. Two
attacks follow, and two checks, made on every request (HTTP, the WebSocket handshake, ``/mcp``)
before anything else runs, close them:

- **DNS rebinding.** The page's name (``attacker.example``) is made to resolve to 127.0.0.1: the
  browser then takes a loopback door, whose console needs no key, for the page's own origin, and
  lets the page read it. The request still says ``Host: attacker.example``. So a door answers only
  the names it is reached by: loopback names (``localhost``, loopback addresses, any port), the
  names in ``ARBITER_DOOR_ALLOWED_HOSTS``, and, when it listens beyond loopback, IP addresses (a
  rebinding needs a name the attacker controls, never an address literal). Others: 421.
- **Cross-origin requests.** A page of another origin sends ``Origin`` (browsers do on every
  cross-origin fetch, every POST and every WebSocket handshake; CORS does not guard WebSockets at
  all). A request whose ``Origin`` is not the door's own (the name and port the request was sent
  to) is refused (403), and so is one the browser marks as from another site
  (``Sec-Fetch-Site``) that is not a navigation: a page elsewhere reads nothing and opens no
  session, while a link to the console still opens it. Clients that are not browsers (the SDK,
  curl, MCP clients) send neither and are unaffected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from arbiter.edge.hosts import HostNames, is_loopback, split_host
from arbiter.edge.settings import Settings

from .errors import Refusal

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HostPolicy:
    """The names a door answers (``arbiter.edge.hosts``), and the check of one request's headers."""

    names: HostNames

    @classmethod
    def of(cls, settings: Settings) -> HostPolicy:
        return cls(HostNames.of(settings.door_allowed_hosts, addresses=not is_loopback(settings.door_host)))

    def allows(self, name: str) -> bool:
        """Whether a request sent to host ``name`` is for this door."""
        return self.names.allows(name)

    def refusal(self, headers: Headers) -> Refusal | None:
        """Why the request with these headers is not answered (None: it is)."""
        host = split_host(headers.get("host", ""))
        if host is None or not self.allows(host[0]):
            shown = headers.get("host", "")[:100]
            return Refusal(421, "host_not_allowed", f"this door does not answer requests for host {shown!r}",
                           "Reach the door by a name it answers: loopback names, or one in "
                           "ARBITER_DOOR_ALLOWED_HOSTS (its operator sets it).")
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, host):
            return Refusal(403, "cross_origin", f"a request from the web origin {origin[:100]!r} is not answered",
                           "Call the door from its own page (its console, /docs), or from a client that is not "
                           "a browser page.")
        site = headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site") and headers.get("sec-fetch-mode") != "navigate":
            return Refusal(403, "cross_origin", f"the browser says this request comes from another site ({site})",
                           "Call the door from its own page (its console, /docs).")
        return None


def _same_origin(origin: str, host: tuple[str, int | None]) -> bool:
    """Whether ``origin`` is the door's own: the name and port the request was sent to. (Not the scheme: a
    door behind a proxy that ends TLS sees http where the page has https.) A browser leaves the port out
    of ``Host`` when it is the default of the page's scheme."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query:
        return False  # "null" (a sandboxed page, a file), or not an origin at all
    default = DEFAULT_PORTS[parts.scheme]
    return parts.hostname.removesuffix(".") == host[0] and (port or default) == (host[1] or default)


class CheckOrigin:
    """Middleware: refuse, before anything else runs, a request for another host or from another origin."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.policy = HostPolicy.of(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self.policy.refusal(Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        log.debug("refused %s %s: %s", scope["type"], scope.get("path"), refusal.detail)
        answer = JSONResponse(refusal.body(), status_code=refusal.status)
        if scope["type"] == "http":
            await answer(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await WebSocket(scope, receive, send).send_denial_response(answer)
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": refusal.reason})
