"""Issuing, rotating and revoking identities: the admin's side of the registry.

The admin key (``<home>/keys/admin.key``, created on first use, with its public half in
``admin.pub``: the trust anchor every process reads) signs every registry record. An
identity's private key goes to ``<home>/keys/<name>.key`` (0600, directory 0700) or is
handed back once for a secret store; only its public half is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import Sender, sender_for
from arbiter.edge.keys import (
    anchors_for,
    identity_problem,
    key_file,
    keys_dir,
    read_private_key,
    registering,
    write_private_key,
)
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas import CompensationRequested, IdentityRegistered, LockRevokeRequested, Record, default_codec
from arbiter.schemas.identity import (
    ACTIVE,
    END_GRACE_MS,
    REVOKED,
    ROLE_ADMIN,
    ROLE_AGENT,
    ROLE_RUNNER,
    ROLE_WORKER,
    ROTATED,
    IdentityError,
    Registry,
    Signer,
    valid_name,
)


def _read_settled(path: Path, name: str) -> Signer:
    """Read a key file that another process may be writing this very moment."""
    for _ in range(40):
        try:
            return read_private_key(path, name)
        except IdentityError:
            if path.stat().st_size > 0 and path.stat().st_mode & 0o077:
                raise
            time.sleep(0.05)
    return read_private_key(path, name)


def admin_signer(home: Path, create: bool = True) -> Signer:
    """The admin key of ``home``; created (with ``admin.pub`` beside it) when missing and ``create``."""
    path = keys_dir(home) / "admin.key"
    if not path.exists():
        if not create:
            raise IdentityError(f"no admin key at {path}: only the admin can change the registry")
        signer = Signer.generate(ROLE_ADMIN)
        if write_private_key(path, signer):
            public = keys_dir(home) / "admin.pub"
            tmp = public.with_suffix(f".pub.{os.getpid()}")
            tmp.write_text(signer.public_text() + "\n")
            os.replace(tmp, public)
            return signer
    return _read_settled(path, ROLE_ADMIN)


@contextlib.asynccontextmanager
async def _sending(settings: Settings, topic: str) -> AsyncIterator[Sender]:
    """A sender to ``topic`` for a few records, stopped on the way out (a failed start included)."""
    sender = sender_for(settings)
    try:
        await sender.start()
        # A sender may start without a broker (librdkafka connects on its first call): asking for the topic
        # says "no broker answers" (or "no such topic") now, not at the send's deadline.
        await sender.partitions(topic)
        yield sender
    finally:
        await sender.stop()


async def _until(at_ms: int) -> None:
    """Return once the wall clock reaches ``at_ms``: when a rotation or revocation takes effect."""
    await asyncio.sleep(max(0, at_ms - now_ms()) / 1000)


class Registrar:
    """The admin's operations on the registry topic."""

    def __init__(self, settings: Settings, create_admin: bool = True) -> None:
        self.settings = settings
        self.admin = admin_signer(settings.home, create=create_admin)
        self.codec = default_codec(settings.max_message_bytes)

    async def entries(self) -> list[IdentityRegistered]:
        """Every key in the registry, as the admin keys signed it."""
        registry = Registry(anchors_for(self.settings.home, self.settings.admin_public_keys))
        feed = RegistryFeed(registry, self.settings)
        await feed.start()
        try:
            return sorted(registry.entries.values(), key=lambda e: (e.name, e.valid_from_ms))
        finally:
            await feed.stop()

    async def publish(self, entries: Iterable[IdentityRegistered]) -> None:
        """Write registry records, each signed by the admin key."""
        topic = self.settings.topics.registry
        async with _sending(self.settings, topic) as sender:
            for entry in entries:
                value = self.codec.encode(entry)
                key = entry.key_id.encode()
                await sender.send(topic, key, value, self.admin.sign(topic, key, value, now_ms()))

    async def add(self, name: str, *, role: str = ROLE_AGENT, tenant: str = "", allow: Iterable[str] = (),
                  keep_key: bool = True) -> Signer:
        """Issue a key to a new identity and register it. ``keep_key``: write the private key under
        the home (else the caller shows it once). Refuses a name that already has an active key."""
        problem = identity_problem(name)
        if problem:
            raise IdentityError(f"{name[:200]!r} cannot be an identity: {problem}")
        if role not in (ROLE_AGENT, ROLE_WORKER, ROLE_RUNNER):
            raise IdentityError(f"role must be {ROLE_AGENT}, {ROLE_WORKER} or {ROLE_RUNNER}, not {role!r}")
        if any(e.name == name and e.status == ACTIVE and not e.credential for e in await self.entries()):
            raise IdentityError(f"{name!r} already has an active key: rotate it ('arbiter agents rotate {name}') "
                                f"or revoke it first")
        signer = Signer.generate(name)
        if keep_key and not write_private_key(key_file(self.settings.home, name), signer):
            raise IdentityError(f"{key_file(self.settings.home, name)} already exists; remove it or rotate {name!r}")
        await self.publish([self._entry(signer, role, tenant, list(allow))])
        return signer

    async def rotate(self, name: str, *, keep_key: bool = True) -> Signer:
        """A new key for ``name`` (same role and prefixes); its old keys stop verifying shortly after.
        Its front-door credentials stay as they are (each is revoked on its own)."""
        current = [e for e in await self.entries() if e.name == name and e.status == ACTIVE and not e.credential]
        if not current:
            raise IdentityError(f"{name!r} has no active key to rotate; add it with 'arbiter agents add {name}'")
        newest = max(current, key=lambda e: e.valid_from_ms)
        signer = Signer.generate(name)
        ends = now_ms() + END_GRACE_MS
        await self.publish([self._entry(signer, newest.role, newest.tenant, newest.allow),
                            *(e.model_copy(update={"status": ROTATED, "valid_until_ms": ends, "reason": "rotated",
                                                   "at_ms": now_ms()}) for e in current)])
        await _until(ends)
        if keep_key:
            path = key_file(self.settings.home, name)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            write_private_key(tmp, signer)
            os.replace(tmp, path)
        return signer

    async def revoke(self, name: str, reason: str) -> list[IdentityRegistered]:
        """Revoke every active key of ``name``, its credentials included; commands appended after the
        returned ends are refused."""
        current = [e for e in await self.entries() if e.name == name and e.status == ACTIVE]
        if not current:
            raise IdentityError(f"{name!r} has no active key")
        ends = now_ms() + END_GRACE_MS
        revoked = [e.model_copy(update={"status": REVOKED, "valid_until_ms": ends, "reason": reason or "revoked",
                                        "at_ms": now_ms()}) for e in current]
        await self.publish(revoked)
        await _until(ends)
        return revoked

    async def issue_credential(self, name: str, *, label: str = "", allow: Iterable[str] | None = None,
                               expires_in_s: float | None = None) -> tuple[Signer, IdentityRegistered]:
        """A front-door credential of agent ``name``: a key pair of its own, registered for ``name`` with
        ``label``, scoped to ``allow`` (at most the agent's prefixes; default: the agent's), ending after
        ``expires_in_s`` if given. Its private key goes back to the caller only (as an API key): the
        agent's own key never leaves its holder."""
        entries = await self.entries()
        own = [e for e in entries if e.name == name and e.status == ACTIVE and not e.credential]
        if not own:
            raise IdentityError(f"{name!r} has no active key: add the agent first ('arbiter agents add {name}')")
        identity = max(own, key=lambda e: e.valid_from_ms)
        if identity.role != ROLE_AGENT:
            raise IdentityError(f"{name!r} is a {identity.role}: only agents use the front door")
        scope = list(identity.allow) if allow is None else [p for p in allow if p]
        outside = [p for p in scope if identity.allow and not any(p.startswith(a) for a in identity.allow)]
        if outside or (identity.allow and not scope):
            raise IdentityError(f"a credential of {name!r} is scoped within its prefixes "
                                f"({', '.join(identity.allow)}); not {', '.join(outside) or 'every resource'}")
        label = label or f"door-{uuid.uuid4().hex[:8]}"
        problem = valid_name(label)
        if problem:
            raise IdentityError(f"credential label {label!r}: {problem}")
        if any(e.name == name and e.credential == label and e.status == ACTIVE for e in entries):
            raise IdentityError(f"{name!r} already has an active credential {label!r}: revoke it first "
                                f"('arbiter agents revoke {name} --credential {label}') or choose another label")
        if expires_in_s is not None and expires_in_s <= 0:
            raise IdentityError("a credential's expiry is a positive duration")
        signer = Signer.generate(name)
        entry = self._entry(signer, ROLE_AGENT, identity.tenant, scope).model_copy(update={
            "credential": label,
            "valid_until_ms": None if expires_in_s is None else now_ms() + round(expires_in_s * 1000)})
        await self.publish([entry])
        return signer, entry

    async def revoke_credential(self, name: str, credential: str, reason: str) -> IdentityRegistered:
        """Revoke one front-door credential of ``name`` (by label or key id); the agent's own key and its
        other credentials stay good. Commands appended after the returned end are refused."""
        found = [e for e in await self.entries() if e.name == name and e.credential and e.status == ACTIVE
                 and (credential in (e.credential, e.key_id) or (len(credential) >= 8
                                                                  and e.key_id.startswith(credential)))]
        if not found:
            raise IdentityError(f"{name!r} has no active credential {credential!r} ('arbiter agents list' shows "
                                "them)")
        if len(found) > 1:
            raise IdentityError(f"{credential!r} names {len(found)} credentials of {name!r}: give the label")
        ends = now_ms() + END_GRACE_MS
        revoked = found[0].model_copy(update={"status": REVOKED, "valid_until_ms": ends, "reason": reason or "revoked",
                                              "at_ms": now_ms()})
        await self.publish([revoked])
        await _until(ends)
        return revoked

    def _entry(self, signer: Signer, role: str, tenant: str, allow: list[str]) -> IdentityRegistered:
        now = now_ms()
        return IdentityRegistered(key_id=signer.key_id, name=signer.name, role=role, public_key=signer.public_raw,
                                  tenant=tenant, allow=allow, status=ACTIVE, valid_from_ms=now, at_ms=now)


async def ensure_identity(settings: Settings, name: str, role: str = ROLE_AGENT) -> Signer:
    """The signer of ``name`` from its key file; when there is none, issue one with this home's
    admin key (used for the workers' identity, and for agents under ``auto_enroll``). A key file
    the registry has never seen (a home reused with new topics) is registered; a key the registry
    knows is never registered again, so a revoked key stays revoked.

    The processes of one home register one name one at a time (``registering``), so two workers
    that start at once on a fresh registry write one record, not two; a second record from
    elsewhere that says the same is a repeat the registry ignores (``Registry.apply``)."""
    problem = identity_problem(name)
    if problem:
        raise IdentityError(f"{name[:200]!r} cannot be an identity: {problem}")
    path = key_file(settings.home, name)
    if path.exists() and not (keys_dir(settings.home) / "admin.key").exists():
        return _read_settled(path, name)  # without the admin key, registering is someone else's job
    async with registering(settings.home, name):
        if not path.exists():
            try:
                return await Registrar(settings).add(name, role=role)
            except IdentityError:
                if path.exists():  # ``arbiter agents add`` (which takes no lock) issued it at this moment
                    return _read_settled(path, name)
                raise
        signer = _read_settled(path, name)
        registrar = Registrar(settings, create_admin=False)
        entries = await registrar.entries()
        if not any(e.key_id == signer.key_id for e in entries):
            if any(e.name == name and e.status == ACTIVE and not e.credential for e in entries):
                raise IdentityError(f"{path} is not {name!r}'s registered key (another key is active); "
                                    f"remove the file, or rotate {name!r}")
            await registrar.publish([registrar._entry(signer, role, "", [])])
        return signer


async def ensure_credential(settings: Settings, name: str) -> Signer:
    """Development (``auto_enroll``): a fresh front-door credential of agent ``name`` (its identity issued
    first if it has none), issued with this home's admin key and good for a day."""
    await ensure_identity(settings, name)
    signer, _entry = await Registrar(settings, create_admin=False).issue_credential(
        name, label=f"auto-{uuid.uuid4().hex[:8]}", expires_in_s=24 * 3600)
    return signer


class Operator:
    """A human's overrides, signed with the admin key: force-release a stuck lease, abort a saga.
    Each carries a reason and names the admin as its sender, so the audit shows it as a human action."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.admin = admin_signer(settings.home, create=False)
        self.codec = default_codec(settings.max_message_bytes)

    async def _send(self, topic: str, key: str, record: Record) -> None:
        async with _sending(self.settings, topic) as sender:
            value = self.codec.encode(record)
            raw = key.encode()
            await sender.send(topic, raw, value, self.admin.sign(topic, raw, value, now_ms()))

    async def revoke(self, resource: str, agent_id: str, reason: str, token: int | None = None) -> str:
        """Force-release ``agent_id``'s lease (or queued request) on ``resource``; the request id."""
        if not reason.strip():
            raise IdentityError("an override needs a reason")
        request_id = f"override|{uuid.uuid4().hex}"
        await self._send(self.settings.topics.resource_commands, resource, LockRevokeRequested(
            request_id=request_id, resource=resource, agent_id=agent_id, token=token, reason=reason,
            requested_by=ROLE_ADMIN, at_ms=now_ms()))
        return request_id

    async def abort_saga(self, saga_id: str, reason: str) -> None:
        """Abort a saga: its completed steps are compensated."""
        if not reason.strip():
            raise IdentityError("an override needs a reason")
        await self._send(self.settings.topics.saga_commands, saga_id, CompensationRequested(
            saga_id=saga_id, reason=reason, requested_by=ROLE_ADMIN, at_ms=now_ms()))
