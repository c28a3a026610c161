"""Standard Webhooks signatures (https://www.standardwebhooks.com, issue #34).

A secret is ``whsec_`` + base64 of 32 random bytes. A message's signature is
``v1,`` + base64(HMAC-SHA256(secret bytes, "<webhook-id>.<webhook-timestamp>.<body>")); while a
rotated-out secret is still valid, the header carries both signatures, space-separated, and a
receiver accepts the message when any one of them verifies.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def secret_bytes(secret: str) -> bytes:
    return base64.b64decode(secret[len(PREFIX):] if secret.startswith(PREFIX) else secret)


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def headers(secrets_: list[str], message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt, signed with every secret given."""
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(s, message_id, timestamp, body) for s in secrets_)}
