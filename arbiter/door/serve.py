"""Run the front door under uvicorn (``arbiter serve``)."""

from __future__ import annotations

import logging

import uvicorn

from arbiter.edge.settings import Settings

from .app import create_app


def serve(settings: Settings, *, host: str | None = None, port: int | None = None, loglevel: str = "warning",
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM; sessions are told to resume elsewhere on the way out."""
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("door").setLevel(logging.INFO)
    config = uvicorn.Config(
        create_app(settings), host=host or settings.door_host, port=settings.door_port if port is None else port,
        log_level=loglevel, access_log=False, lifespan="on", loop="uvloop", http="httptools",
        ws="websockets-sansio", ws_max_size=settings.door_max_body_bytes, ws_ping_interval=20.0,
        ws_ping_timeout=20.0, limit_concurrency=settings.door_max_connections, timeout_graceful_shutdown=5,
        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    uvicorn.Server(config).run()
