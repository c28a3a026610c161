"""Standard Webhooks signatures (https://www.standardwebhooks.com, issue #34), signed by the
specification's own library, ``standardwebhooks``.

A secret is ``whsec_`` + base64 of 32 random bytes. A message's signature is
``v1,`` + base64(HMAC-SHA256(secret bytes, "<webhook-id>.<webhook-timestamp>.<body>")), the body
signed byte for byte as sent; while a rotated-out secret is still valid, the header carries both
signatures, space-separated, and a receiver accepts the message when any one of them verifies.
(Receivers verify with ``standardwebhooks`` or with ``rev88.webhooks.verify``, which needs only
the standard library; tests/test_webhooks.py checks each against the other, both ways.)
"""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime

from standardwebhooks import Webhook

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64>``: the one signature of this secret (``timestamp``: whole Unix seconds)."""
    return Webhook(secret).sign(message_id, datetime.fromtimestamp(timestamp, tz=UTC), body)


def headers(secrets_: list[str], message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt, signed with every secret given."""
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(s, message_id, timestamp, body) for s in secrets_)}
