"""Key files: where an identity's private key lives on disk, and the trust anchors this machine reads.

The signing itself is pure and lives with the wire contract (``arbiter.schemas.identity``); this
module is the file I/O around it: ``<home>/keys/NAME.key`` (0600, directory 0700), the admin's
public key ``<home>/keys/admin.pub`` (or ``ARBITER_ADMIN_PUBLIC_KEYS``), and a secret store's key
text.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from arbiter.schemas.identity import ROLE_ADMIN, IdentityError, Signer, parse_public_keys, valid_name


def keys_dir(home: Path) -> Path:
    """Where this home keeps private keys (0700)."""
    return home / "keys"


def key_file(home: Path, name: str) -> Path:
    """The private key file of ``name`` under ``home``."""
    problem = valid_name(name) if name != ROLE_ADMIN else None
    if problem:
        raise IdentityError(f"{name!r} cannot be an identity: {problem}")
    return keys_dir(home) / f"{name}.key"


def write_private_key(path: Path, signer: Signer) -> bool:
    """Write ``signer``'s private key to ``path`` with 0600 permissions, never over an existing
    file. False when the file already exists (someone else created it first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as out:
        out.write(signer.private_pem())
    return True


@asynccontextmanager
async def registering(home: Path, name: str, timeout: float = 60.0) -> AsyncIterator[None]:
    """Hold this home's lock on registering ``name`` (``<home>/keys/.NAME.lock``), so that processes
    sharing a home that register one identity at once (workers starting together, agents enrolled
    by ``auto_enroll``) do it one after the other: the later one finds the key registered. The lock
    is the kernel's (``flock``): a process that dies holding it releases it."""
    path = key_file(home, name).with_name(f".{name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise IdentityError(f"another process has been registering {name!r} for {timeout:.0f} s "
                                        f"({path} is locked); is it stuck?") from None
                await asyncio.sleep(0.02)  # polled, not a blocking flock: the event loop goes on meanwhile
        yield
    finally:
        os.close(fd)  # releases the lock


def read_private_key(path: Path, name: str) -> Signer:
    """The signer whose private key is in ``path``; refuses files others can read."""
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except FileNotFoundError:
        raise IdentityError(f"no key for {name!r} at {path}: run 'arbiter agents add {name}'") from None
    if mode & 0o077:
        raise IdentityError(f"{path} is readable by others (mode {mode:o}); run 'chmod 600 {path}'")
    return Signer.from_text(name, data)


def anchors_for(home: Path, configured: str) -> list[bytes]:
    """The admin public keys to trust: ``configured`` (base64 list), else ``<home>/keys/admin.pub``."""
    if configured.strip():
        return parse_public_keys(configured)
    path = keys_dir(home) / "admin.pub"
    try:
        return parse_public_keys(path.read_text())
    except FileNotFoundError:
        return []


def identity_problem(name: str) -> str | None:
    """Why an agent, worker or runner cannot be called ``name`` (None: it can): an invalid name, or
    the admin key's (a process that signed as ``admin`` would act with the home's trust anchor)."""
    if name == ROLE_ADMIN:
        return f"{ROLE_ADMIN!r} is the name of this home's admin key, the registry's trust anchor: give the " \
               f"agent, worker or runner a name of its own"
    return valid_name(name)


def signer_for(home: Path, name: str, key_text: str = "") -> Signer:
    """The signer of ``name``: from ``key_text`` (a secret store's value) if given, else its key file."""
    problem = identity_problem(name)
    if problem:
        raise IdentityError(f"{name[:200]!r} cannot be an identity: {problem}")
    if key_text:
        return Signer.from_text(name, key_text)
    return read_private_key(key_file(home, name), name)
