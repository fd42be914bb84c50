"""Run the front door under uvicorn (``arbiter serve``)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import uvicorn

from arbiter.edge.settings import Settings

from .app import create_app
from .state import Door


class ListenError(OSError):
    """The door's address cannot be listened on (in use, not this host's, a privileged port)."""


def listen(host: str, port: int) -> socket.socket:
    """A socket bound and listening on ``host:port`` (0: any free port), before anything says ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve(settings: Settings, *, host: str | None = None, port: int | None = None, loglevel: str = "warning",
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
          on_ready: Callable[[Door, str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; sessions are told to resume elsewhere on the way out. The address is
    bound first (``ListenError`` if it cannot be); ``on_ready(door, url)`` once the door serves."""
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("arbiter.door").setLevel(logging.INFO)
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    host = host or settings.door_host
    # What the door answers depends on where it listens (a loopback console needs no key): the address
    # given on the command line is the one.
    settings = settings.model_copy(update={"door_host": host})
    sock = listen(host, settings.door_port if port is None else port)
    bound = sock.getsockname()[1]
    scheme = "https" if ssl_certfile else "http"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{bound}"
    config = uvicorn.Config(
        create_app(settings, on_ready=(lambda door: on_ready(door, url)) if on_ready else None),
        log_level=loglevel, access_log=False, lifespan="on", loop="uvloop", http="httptools",
        ws="websockets-sansio", ws_max_size=settings.door_max_body_bytes, ws_ping_interval=20.0,
        ws_ping_timeout=20.0, limit_concurrency=settings.door_max_connections, timeout_graceful_shutdown=5,
        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
