"""Who sent a message: Ed25519 keys, the signature header, and the registry of keys.

Theory of operation
-------------------
Every identity (an agent, the workers, an admin) has an Ed25519 key pair. Whoever
produces a message signs it, in three record headers::

    arbiter-kid   the signing key's id (hex, 32 chars: SHA-256 of the raw public key, first 16 bytes)
    arbiter-at    when it was signed, ms since the epoch (ASCII digits)
    arbiter-sig   the 64-byte Ed25519 signature over ``signed_payload``

``signed_payload`` covers the topic, the key, the value bytes, the signer's name and the
signing time, each length-prefixed, so a signature is good for exactly one message on one
topic under one key from one identity: moving it to another topic, key or identity breaks
it. A replayed message is covered by request-id idempotence (``arbiter.streams.cores.leases``).

The registry topic holds one ``IdentityRegistered`` per key (keyed by key id, compacted),
each signed by an admin key. The admin keys are the trust anchors: their public keys are
given to every process out of band (``<home>/keys/admin.pub`` or
``ARBITER_ADMIN_PUBLIC_KEYS``), never read from Kafka, so write access to the registry
topic alone cannot make anyone an identity.

A key stops being good when it is rotated or revoked: its record gets ``valid_until_ms``,
and a message appended by the broker at or after that time does not verify. The end is
set a little in the future when the change is made (``END_GRACE_MS``), so that every
worker has read it before it takes effect and a replay decides exactly as the workers did.
A key's records only move forward (active, then ended), so an old record written again
cannot bring an ended key back. A record that says what the one in effect says, written at
another moment (two processes registering one key at once), is a repeat: it changes nothing
and is not refused.

Credentials: an identity's own key never leaves its holder. What an agent hands to the
front door (an API key) is a *credential*: a key pair of its own, registered for the same
identity with a label (``IdentityRegistered.credential``), scoped to at most the
identity's prefixes, ending at an expiry if it was issued with one, and revoked alone.
The door signs the agent's commands with it, so a worker (and an audit) verifies them as
any signature, names the credential that made them, and applies the credential's scope.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import nacl.bindings
import nacl.exceptions
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from arbiter.schemas.models import IdentityRegistered
from arbiter.schemas.reasons import Reason
from arbiter.schemas.roles import RESERVED_PREFIXES, ROLE_ADMIN, ROLE_AGENT, ROLE_RUNNER, ROLE_WORKER, ROLES

__all__ = ["RESERVED_PREFIXES", "ROLES", "ROLE_ADMIN", "ROLE_AGENT", "ROLE_RUNNER", "ROLE_WORKER"]

HEADER_KEY_ID = "arbiter-kid"
HEADER_AT = "arbiter-at"
HEADER_SIG = "arbiter-sig"
SIGNATURE_HEADERS = (HEADER_KEY_ID, HEADER_AT, HEADER_SIG)
HEADER_PROOF = "arbiter-proof"
"""On a message signed as one of a batch: its path to the batch's signed root (see ``Signer.sign_batch``)."""
BATCH_GROUP = 64
"""The most messages under one batch signature (a proof is at most 6 steps of 33 bytes)."""
_MAX_PROOF_STEPS = 32
_ROOTS_KEPT = 4096


ACTIVE = "active"
ROTATED = "rotated"
REVOKED = "revoked"

END_GRACE_MS = 2_000
"""A rotation or revocation takes effect this long after it is written (see above)."""


Headers = Sequence[tuple[str, bytes]]
_PAYLOAD_TAG = b"arbiter-signed/1"
_ROOT_TAG = b"arbiter-batch/1"


class IdentityError(ValueError):
    """A key file or key text that cannot be used, with what to do about it."""


def key_id_of(public_raw: bytes) -> str:
    """The id of a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_raw).hexdigest()[:32]


def signed_payload(topic: str, key: bytes | None, value: bytes, name: str, at_ms: int) -> bytes:
    """The bytes a signature covers (length-prefixed, so no two messages share them)."""
    parts = (topic.encode(), key if key is not None else b"\xff", value, name.encode())
    return b"".join([_PAYLOAD_TAG, *(struct.pack(">I", len(p)) + p for p in parts), struct.pack(">q", at_ms)])


def _leaf(payload: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + payload).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_proofs(leaves: list[bytes]) -> tuple[bytes, list[bytes]]:
    """The root over ``leaves`` and each leaf's proof: per level, a side byte (0: the sibling is on
    the left, 1: on the right) and the sibling's hash; a node without a sibling moves up as it is."""
    proofs = [bytearray() for _ in leaves]
    level = [(h, [i]) for i, h in enumerate(leaves)]
    while len(level) > 1:
        up = []
        for j in range(0, len(level) - 1, 2):
            (left, lows), (right, highs) = level[j], level[j + 1]
            for i in lows:
                proofs[i] += b"\x01" + right
            for i in highs:
                proofs[i] += b"\x00" + left
            up.append((_node(left, right), lows + highs))
        if len(level) % 2:
            up.append(level[-1])
        level = up
    return level[0][0], [bytes(p) for p in proofs]


def root_of(payload: bytes, proof: bytes) -> bytes | None:
    """The root that ``payload`` and its ``proof`` lead to (None: the proof is malformed)."""
    if len(proof) % 33 or len(proof) // 33 > _MAX_PROOF_STEPS:
        return None
    digest = _leaf(payload)
    for i in range(0, len(proof), 33):
        side, sibling = proof[i], proof[i + 1:i + 33]
        if side == 1:
            digest = _node(digest, sibling)
        elif side == 0:
            digest = _node(sibling, digest)
        else:
            return None
    return digest


API_KEY_PREFIX = "arb2"
"""An API key: ``arb2.<name>.<credential private key>``. (``arb1`` keys carried an identity's own key;
they still parse, and the front door refuses any key that is not a registered credential.)"""
_API_KEY_PREFIXES = ("arb1", API_KEY_PREFIX)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64url(text: str) -> bytes:
    if not text or len(text) > 400:
        raise ValueError("empty or too long")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.@:")
"""What an identity's name is made of: it names a key file, and appears in logs, topics' keys and URLs."""


def valid_name(name: str) -> str | None:
    """Why ``name`` cannot be an identity (None: it can)."""
    if not name or len(name) > 200:
        return "a name is 1 to 200 characters"
    if not set(name) <= NAME_CHARACTERS:
        odd = "".join(sorted(set(name) - NAME_CHARACTERS))[:10]
        return f"a name is made of letters, digits and - _ . @ : (not {odd!r})"
    if any(name.startswith(p) for p in RESERVED_PREFIXES):
        return f"names starting with {', '.join(RESERVED_PREFIXES)} are reserved for sagas"
    if name in (".", "..") or name[0] in "-.":
        return "a name does not start with '-' or '.'"
    return None


class PublicKey:
    """An Ed25519 public key that verifies with libsodium (``crypto_sign_open``): ~40% less CPU than
    OpenSSL's on the machines measured, and the check every worker, SDK and audit does per message.
    Keys are still read and written with ``cryptography``; this is the hot path only."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) != nacl.bindings.crypto_sign_PUBLICKEYBYTES:
            raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
        self.raw = bytes(raw)

    def verify(self, signature: bytes, data: bytes) -> None:
        """Nothing if ``signature`` is this key's over ``data``; else ``InvalidSignature``."""
        if len(signature) != nacl.bindings.crypto_sign_BYTES:
            raise InvalidSignature("an Ed25519 signature is 64 bytes")
        try:
            nacl.bindings.crypto_sign_open(signature + data, self.raw)
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
            raise InvalidSignature("the signature does not match") from None


@dataclass
class Signer:
    """One identity's private key: signs what this process produces (with libsodium, as it verifies)."""

    name: str
    private_key: Ed25519PrivateKey
    key_id: str = field(init=False)
    public_raw: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.public_raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = key_id_of(self.public_raw)
        self._kid = self.key_id.encode()
        seed = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
        self._secret = nacl.bindings.crypto_sign_seed_keypair(seed)[1]

    def _sign(self, data: bytes) -> bytes:
        return nacl.bindings.crypto_sign(data, self._secret)[:nacl.bindings.crypto_sign_BYTES]

    @classmethod
    def generate(cls, name: str) -> Signer:
        """A new key pair for ``name``."""
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def from_text(cls, name: str, text: str | bytes) -> Signer:
        """A signer from a PEM (PKCS#8) private key, or its raw 32 bytes in base64."""
        data = text.encode() if isinstance(text, str) else text
        try:
            if b"-----BEGIN" in data:
                key = serialization.load_pem_private_key(data, password=None)
            else:
                key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(data.strip(), validate=True))
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"the private key of {name!r} cannot be read: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"the private key of {name!r} is not an Ed25519 key")
        return cls(name, key)

    def private_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (keep it secret)."""
        return self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption())

    def api_key(self) -> str:
        """This key as one bearer string for the front door (``arbiter serve``): the identity's name and
        the private key. Only a credential's key is made into one (``arbiter agents api-key NAME``): the
        door signs the agent's commands with it and keeps it only in memory, and it can be revoked
        without touching the identity's own key."""
        raw = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                             serialization.NoEncryption())
        return f"{API_KEY_PREFIX}.{_b64url(self.name.encode())}.{_b64url(raw)}"

    @classmethod
    def from_api_key(cls, text: str) -> Signer:
        """The signer an API key (``api_key``) carries; ``IdentityError`` if it is not one."""
        parts = text.strip().split(".")
        if len(parts) != 3 or parts[0] not in _API_KEY_PREFIXES:
            raise IdentityError(f"an API key looks like '{API_KEY_PREFIX}.<name>.<key>' "
                                "(from 'arbiter agents api-key NAME')")
        try:
            name = _unb64url(parts[1]).decode()
            key = Ed25519PrivateKey.from_private_bytes(_unb64url(parts[2]))
        except (ValueError, UnicodeDecodeError):
            raise IdentityError("the API key is malformed") from None
        return cls(name, key)

    def public_text(self) -> str:
        """The raw public key, base64."""
        return base64.b64encode(self.public_raw).decode()

    def sign(self, topic: str, key: bytes | None, value: bytes, at_ms: int) -> list[tuple[str, bytes]]:
        """The signature headers for one message."""
        signature = self._sign(signed_payload(topic, key, value, self.name, at_ms))
        return [(HEADER_KEY_ID, self._kid), (HEADER_AT, str(at_ms).encode()), (HEADER_SIG, signature)]

    def sign_batch(self, messages: Sequence[tuple[str, bytes | None, bytes]],
                   at_ms: int) -> list[list[tuple[str, bytes]]]:
        """Signature headers for many messages (topic, key, value) with one signature per
        ``BATCH_GROUP``: the signature covers the root of a Merkle tree over the messages' signed
        payloads, and each message carries its path to that root (``HEADER_PROOF``), so each still
        verifies on its own. A group of one is signed as by ``sign``."""
        out: list[list[tuple[str, bytes]]] = []
        stamp = str(at_ms).encode()
        for start in range(0, len(messages), BATCH_GROUP):
            group = messages[start:start + BATCH_GROUP]
            if len(group) == 1:
                out.append(self.sign(*group[0], at_ms))
                continue
            root, proofs = merkle_proofs([_leaf(signed_payload(t, k, v, self.name, at_ms)) for t, k, v in group])
            signature = self._sign(_ROOT_TAG + root)
            out.extend([(HEADER_KEY_ID, self._kid), (HEADER_AT, stamp), (HEADER_SIG, signature),
                        (HEADER_PROOF, proof)] for proof in proofs)
        return out


@dataclass(frozen=True)
class Verified:
    """A message whose signature checks out, and the identity that signed it."""

    identity: IdentityRegistered
    signed_at_ms: int

    @property
    def name(self) -> str:
        """The signer's name."""
        return self.identity.name

    @property
    def role(self) -> str:
        """The signer's role."""
        return self.identity.role


@dataclass(frozen=True)
class Refused:
    """Why a message is not accepted (a stable reason code and a detail)."""

    reason: Reason
    detail: str
    unknown_key: bool = False
    """Signed by a key the registry does not know (yet): worth one look at the registry's latest."""


MAX_AT_MS = 2**63 - 1
"""A signing time is a signed 64-bit count of milliseconds (``signed_payload`` packs it so)."""
_HEX = frozenset(b"0123456789abcdef")
_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class Signature:
    """The signature headers of one message, parsed: key id, signing time, signature, batch proof."""

    kid: str
    at_ms: int
    sig: bytes
    proof: bytes | None


def signature_of(headers: Headers | None) -> Signature | Refused:
    """The signature a message carries, or why it carries none that can be checked.

    Headers are input like any other: each of ``arbiter-kid``/``-at``/``-sig``/``-proof`` may appear
    at most once, the key id is 32 lowercase hex digits, the time 1 to 19 ASCII digits within a
    signed 64-bit integer, the signature 64 bytes. Anything else is ``unauthenticated``, never an
    exception."""
    found: dict[str, bytes | None] = {}
    for key, value in headers or ():
        if key in _SIGNED_HEADERS:
            if key in found:
                return Refused(Reason.UNAUTHENTICATED, f"the {key} header appears more than once")
            found[key] = None if value is None else bytes(value)
    kid, at, sig = (found.get(h) for h in SIGNATURE_HEADERS)
    if kid is None or at is None or sig is None:
        return Refused(Reason.UNAUTHENTICATED, "the message is not signed (no arbiter-kid/-at/-sig headers)")
    if len(kid) != 32 or not set(kid) <= _HEX:
        return Refused(Reason.UNAUTHENTICATED, "the arbiter-kid header is not a key id (32 lowercase hex digits)")
    if not 0 < len(at) <= 19 or not set(at) <= _DIGITS or int(at) > MAX_AT_MS:
        return Refused(Reason.UNAUTHENTICATED, "the arbiter-at header is not a signing time (ms since the epoch, "
                                               "ASCII digits, within a signed 64-bit integer)")
    if len(sig) != 64:
        return Refused(Reason.UNAUTHENTICATED, f"the arbiter-sig header is {len(sig)} bytes, not an Ed25519 "
                                               "signature (64)")
    proof = found.get(HEADER_PROOF)
    if HEADER_PROOF in found and proof is None:
        return Refused(Reason.UNAUTHENTICATED, "the arbiter-proof header has no value")
    return Signature(kid.decode("ascii"), int(at), sig, proof)


_SIGNED_HEADERS = frozenset((*SIGNATURE_HEADERS, HEADER_PROOF))
_STATUS_RANK = {ACTIVE: 0}
"""How far along its life a key's record is: active, then ended (rotated or revoked). A key's
records only move forward, so an old record written again (or copied to another partition of the
registry topic) can never bring an ended key back."""


_WHEN_WRITTEN: set[str] = {"at_ms", "valid_from_ms"}
"""The fields of a registry record that say when the admin wrote it, not what it says."""


def repeats(new: IdentityRegistered, old: IdentityRegistered) -> bool:
    """Whether ``new`` says what ``old`` (the same key's record in effect) says, written at another
    moment: two processes that register one key at once (two workers starting on a fresh registry)
    each write such a record, in either order. A repeat changes nothing, and is never a refusal."""
    return new.model_dump(exclude=_WHEN_WRITTEN) == old.model_dump(exclude=_WHEN_WRITTEN)


def _later(new: IdentityRegistered, old: IdentityRegistered) -> bool:
    """Whether ``new`` may replace ``old`` (the same key's record): never back to active once ended, never
    to an earlier record, and an ended key's end never moves later."""
    rank_new, rank_old = _STATUS_RANK.get(new.status, 1), _STATUS_RANK.get(old.status, 1)
    if rank_new != rank_old:
        return rank_new > rank_old
    ends, new_ends = old.valid_until_ms, new.valid_until_ms
    if rank_old and ends is not None and (new_ends is None or new_ends > ends):
        return False
    return new.at_ms >= old.at_ms


class Registry:
    """Every key the admin registered, as read from the registry topic, and the check of a signature."""

    def __init__(self, anchors: Iterable[bytes]) -> None:
        self._anchors: dict[str, PublicKey] = {}
        for raw in anchors:
            self._anchors[key_id_of(raw)] = PublicKey(raw)
        self.entries: dict[str, IdentityRegistered] = {}
        self._keys: dict[str, PublicKey] = {}
        self.refused: list[str] = []
        """Registry records that were not signed by an anchor (never applied)."""
        self.repeats = 0
        """Admin-signed records that repeated the record in effect for their key (``repeats``): no-ops."""
        self._roots: dict[tuple[str, bytes, bytes], None] = {}
        """Batch roots whose signature verified (the oldest forgotten first): the other messages of a
        batch cost a few hashes, not a signature check."""

    @property
    def anchor_ids(self) -> frozenset[str]:
        """Key ids of the trust anchors."""
        return frozenset(self._anchors)

    def apply(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
              record: IdentityRegistered) -> Refused | None:
        """Apply one registry record if an anchor signed it; else say why not (and change nothing)."""
        signature = signature_of(headers)
        if isinstance(signature, Refused):
            self.refused.append(record.key_id)
            return signature
        anchor = self._anchors.get(signature.kid)
        if anchor is None or signature.proof is not None:
            self.refused.append(record.key_id)
            return Refused(Reason.UNAUTHENTICATED, f"registry record for {record.name!r} is not signed by an admin key")
        try:
            anchor.verify(signature.sig, signed_payload(topic, key, value, ROLE_ADMIN, signature.at_ms))
        except InvalidSignature:
            self.refused.append(record.key_id)
            return Refused(Reason.UNAUTHENTICATED, f"registry record for {record.name!r}: bad admin signature")
        if key != record.key_id.encode() or len(record.public_key) != 32 \
                or key_id_of(record.public_key) != record.key_id:
            self.refused.append(record.key_id)
            return Refused(Reason.UNAUTHENTICATED, "registry record's key id does not match its public key")
        known = self.entries.get(record.key_id)
        if known is not None and repeats(record, known):
            self.repeats += 1  # the record in effect stays: its times are when the key was first registered
            return None
        if known is not None and not _later(record, known):
            return Refused(Reason.UNAUTHENTICATED, f"registry record for {record.name!r} ({record.status}) is older "
                                                   f"than the one in effect ({known.status}): ignored")
        self.entries[record.key_id] = record
        self._keys[record.key_id] = PublicKey(record.public_key)
        return None

    def current(self, name: str) -> list[IdentityRegistered]:
        """Every key of ``name``, newest first."""
        return sorted((e for e in self.entries.values() if e.name == name), key=lambda e: -e.valid_from_ms)

    def knows(self, key_id: str) -> bool:
        """Whether ``key_id`` is registered (or is an anchor)."""
        return key_id in self._keys or key_id in self._anchors

    def verify(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
               appended_at_ms: int) -> Verified | Refused:
        """Who signed this message, appended by the broker at ``appended_at_ms``; or why it is refused."""
        signature = signature_of(headers)
        if isinstance(signature, Refused):
            return signature
        kid, at, sig = signature.kid, signature.at_ms, signature.sig
        entry = self.entries.get(kid)
        public = self._keys.get(kid)
        if entry is None or public is None:
            anchor = self._anchors.get(kid)
            if anchor is None:
                return Refused(Reason.UNAUTHENTICATED, f"unknown signing key {kid[:16]}", unknown_key=True)
            # An admin key signs as "admin" even before (or without) its own registry record.
            entry = IdentityRegistered(key_id=kid, name=ROLE_ADMIN, role=ROLE_ADMIN, public_key=b"\0" * 32,
                                       status=ACTIVE, valid_from_ms=0, at_ms=0)
            public = anchor
        if entry.valid_until_ms is not None and appended_at_ms >= entry.valid_until_ms:
            return Refused(Reason.UNAUTHENTICATED, f"the key {kid[:16]} of {entry.name!r} "
                                                   f"{'expired' if entry.status == ACTIVE else 'was ' + entry.status} "
                                                   f"at {entry.valid_until_ms}")
        payload = signed_payload(topic, key, value, entry.name, at)
        proof = signature.proof
        root: bytes | None = None
        if proof is None:
            signed = payload
        else:
            root = root_of(payload, proof)
            if root is None:
                return Refused(Reason.UNAUTHENTICATED, "the batch proof is malformed")
            signed = _ROOT_TAG + root
            if (kid, sig, root) in self._roots:
                return Verified(entry, at)  # this batch's signature was checked already
        try:
            public.verify(sig, signed)
        except InvalidSignature:
            return Refused(Reason.UNAUTHENTICATED, f"the signature by {entry.name!r} does not match the message")
        if proof is not None and root is not None:
            if len(self._roots) >= _ROOTS_KEPT:
                self._roots.pop(next(iter(self._roots)))
            self._roots[(kid, sig, root)] = None
        return Verified(entry, at)


def parse_public_keys(text: str) -> list[bytes]:
    """Raw public keys from base64 text, comma or whitespace separated."""
    keys = []
    for item in text.replace(",", " ").split():
        try:
            raw = base64.b64decode(item, validate=True)
        except ValueError:
            raise IdentityError(f"{item[:20]!r} is not a base64 public key") from None
        if len(raw) != 32:
            raise IdentityError(f"a public key is 32 bytes, {item[:20]!r} is {len(raw)}")
        keys.append(raw)
    return keys
