"""The front door's routes, one router per area: leases, the gateway, sagas, status, sessions."""

from __future__ import annotations

from fastapi import APIRouter

from . import console, gateway, leases, sagas, session, status

ROUTERS: tuple[APIRouter, ...] = (leases.router, gateway.router, sagas.router, status.router, session.router,
                                  console.router)
"""Every router, in the order /docs lists them."""
