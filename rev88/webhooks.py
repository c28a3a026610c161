"""Receiving the service's webhooks: ``verify`` checks a delivery's Standard Webhooks signature.

    from rev88.webhooks import verify, WebhookVerificationError

    event = verify(request.headers, raw_body, secret)   # the parsed JSON body, or an exception

``secret`` is the ``whsec_...`` key of ``GET /webhooks/secret`` (a list of them is accepted
too, while moving to a rotated one). The check: the three headers are present; the timestamp is
within ``tolerance_s`` of now (a replayed old message is refused); one ``v1`` signature in
``webhook-signature`` equals HMAC-SHA256(secret, "<id>.<timestamp>.<body>"), compared in constant
time. Deduplicate on ``webhook-id``: a retry carries the same id (and the same body).
Standard library only: a receiver needs neither the service nor httpx.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "whsec_"


class WebhookVerificationError(ValueError):
    """The delivery is not one the secret signed (the message says which check failed)."""


def _key(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    try:
        return base64.b64decode(secret[len(PREFIX):] if secret.startswith(PREFIX) else secret, validate=True)
    except (binascii.Error, ValueError):
        raise WebhookVerificationError("the secret is not a whsec_ key (base64 after the prefix)") from None


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    raise WebhookVerificationError(f"the {name} header is missing")


def verify(headers: Mapping[str, str], body: bytes | str, secret: str | bytes | Sequence[str | bytes],
           tolerance_s: float = 300.0, now: float | None = None) -> Any:
    """The delivery's parsed JSON body once its signature verifies; WebhookVerificationError otherwise."""
    message_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    signatures = _header(headers, "webhook-signature")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError(f"webhook-timestamp {stamp[:40]!r} is not whole seconds") from None
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        raise WebhookVerificationError(f"webhook-timestamp is {now - timestamp:+.0f} s from now; at most "
                                       f"{tolerance_s:g} s either way")
    raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
    signed = f"{message_id}.{timestamp}.".encode() + raw
    keys = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    expected = [hmac.new(_key(k), signed, hashlib.sha256).digest() for k in keys]
    for part in signatures.split():
        version, _, value = part.partition(",")
        if version != "v1":
            continue
        try:
            given = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if any(hmac.compare_digest(given, e) for e in expected):
            try:
                return json.loads(raw)
            except ValueError:
                raise WebhookVerificationError("the body is signed but is not JSON") from None
    raise WebhookVerificationError("no v1 signature in webhook-signature matches the secret")
