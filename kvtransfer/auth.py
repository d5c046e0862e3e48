"""Mutual HMAC challenge-response: both peers prove they hold the cluster secret.

Each side contributes a fresh 32-byte nonce; each proof is
``HMAC-SHA256(secret, label | role | sender_nonce | receiver_nonce)``. The role in the
message stops a reflection attack (replaying the receiver's proof as the sender's), the
two nonces stop replays across connections, and the receiver proves itself first so a
sender never answers an impostor. Proofs are compared with ``hmac.compare_digest``.

Without a secret (loopback-only deployments, see ``config.py``) the same exchange runs
with an empty key: it proves nothing, it just keeps one code path. A peer with a secret
and a peer without one fail the exchange like two different secrets do.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import secrets

from kvtransfer.protocol import NONCE_BYTES, PDSERVE_KV_PROTOCOL_VERSION

_LABEL = f"pdserve-kv/{PDSERVE_KV_PROTOCOL_VERSION}|".encode()


class Role(enum.Enum):
    SENDER = b"sender"
    RECEIVER = b"receiver"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def make_proof(secret: bytes | None, role: Role, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    msg = _LABEL + role.value + b"|" + sender_nonce + receiver_nonce
    return hmac.new(secret or b"", msg, hashlib.sha256).digest()


def check_proof(secret: bytes | None, role: Role, sender_nonce: bytes, receiver_nonce: bytes,
                proof: bytes) -> bool:
    return hmac.compare_digest(make_proof(secret, role, sender_nonce, receiver_nonce), proof)
