"""The front door (``arbiter serve``): HTTP and WebSocket access to Arbiter for agents in any language.

``create_app(settings)`` is the FastAPI application; ``arbiter.door.state`` keeps the agents it
serves; ``arbiter.door.serve`` runs it under uvicorn.
"""

from .app import create_app
from .state import Door

__all__ = ["Door", "create_app"]
