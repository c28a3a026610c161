"""Tenants (issue #33): who a request is, from its Bearer key, and what that key may do.

With ``REV88_API_KEY`` set, that key is the admin's (``ADMIN``: every scope, sees everything);
the admin makes more keys (``KeyRing.create``), each a tenant with its own scopes and limits.
A key's secret is shown once, at creation or rotation, and stored only as its SHA-256
(app/ledger/keys.py): a presented key is hashed and looked up by that hash, then the hash is
compared in constant time. Without ``REV88_API_KEY`` the service is open (``OPEN``), as before.

Scopes: ``read`` (GET and HEAD), ``write`` (everything else that submits, uploads or cancels),
``admin`` (the keys themselves; implies the others). A resolved key is cached for
``CACHE_S`` seconds, so a revocation holds on the replica that made it at once and on every
other replica within ``CACHE_S``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import secrets
import threading
import time
import uuid
from typing import Any

from ..errors import Forbidden, InvalidRequest, NotFound, TooManyRequests
from ..ledger.keys import KeyRecord, open_keys

SCOPES = ("read", "write", "admin")
DEFAULT_SCOPES = ("read", "write")
SHARE_CACHE_S = 5.0  # a tenant's weight, running limit and revocation (for its waiting work), re-read this often
CACHE_S = 1.0  # how long a resolved key is trusted before it is read again (revocation delay elsewhere)
TOUCH_S = 60.0  # last_used_at is written at most once a minute per key
GRACE_DEFAULT_S = 3600.0  # a rotated-out secret keeps working this long unless asked otherwise
GRACE_MAX_S = 7 * 86400.0
SECRET_PREFIX = "rev88_"


@dataclasses.dataclass(frozen=True)
class Tenant:
    id: str  # "admin", "open", or the key's id
    name: str
    scopes: frozenset[str]
    key: KeyRecord | None = None

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def owner(self) -> str | None:
        """The owner its work is recorded under; None: sees every owner's (the admin, an open service)."""
        return None if self.admin else self.id

    def can(self, scope: str) -> bool:
        return self.admin or scope in self.scopes


ADMIN = Tenant("admin", "admin", frozenset(SCOPES))
OPEN = Tenant("open", "open", frozenset(SCOPES))


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> tuple[str, str]:
    """(secret, prefix): 43 random URL-safe characters after ``rev88_``; the prefix shows 6 of them."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    return secret, secret[: len(SECRET_PREFIX) + 6]


def scope_for(method: str) -> str:
    return "read" if method in ("GET", "HEAD", "OPTIONS") else "write"


class KeyRing:
    """The service's keys, over their store (what the middleware and the /keys routes call)."""

    def __init__(self, datasets_store: Any, admin_key: str | None) -> None:
        self.store = open_keys(datasets_store)
        self.admin_key = admin_key
        self._cache: dict[str, tuple[float, Tenant | str]] = {}  # hash -> (until, tenant or refusal)
        self._shares: dict[str, tuple[float, tuple[float, int | None, str | None]]] = {}  # owner -> (until, limits)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ who is asking
    def resolve_fast(self, token: str) -> Tenant | str | None:
        """The answer when no I/O is needed (the admin key, a key resolved within CACHE_S, a token
        that cannot be a key); None: ``resolve`` must read the store."""
        if self.admin_key is not None and hmac.compare_digest(token.encode(), self.admin_key.encode()):
            return ADMIN
        if not token.startswith(SECRET_PREFIX):
            return "invalid API key"
        with self._lock:
            hit = self._cache.get(digest(token))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def resolve(self, token: str) -> Tenant | str:
        """(blocking on a cache miss) The tenant a Bearer token is, or why it is refused."""
        fast = self.resolve_fast(token)
        if fast is not None:
            return fast
        h = digest(token)
        record = self.store.find(h)
        answer = self._judge(record, h)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[h] = (time.monotonic() + CACHE_S, answer)
        if isinstance(answer, Tenant) and (record.last_used_at is None or time.time() - record.last_used_at > TOUCH_S):
            self.store.touch(record.id, time.time())
        return answer

    @staticmethod
    def _judge(record: KeyRecord | None, h: str) -> Tenant | str:
        if record is None:
            return "invalid API key"
        matches = hmac.compare_digest(record.secret_sha256, h) or (
            record.previous_sha256 is not None and hmac.compare_digest(record.previous_sha256, h))
        if not matches:
            return "invalid API key"
        if record.revoked_at is not None:
            return f"key {record.name!r} ({record.prefix}…) was revoked"
        if record.expires_at is not None and record.expires_at <= time.time():
            return f"key {record.name!r} ({record.prefix}…) expired"
        return Tenant(record.id, record.name, frozenset(record.scopes), record)

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()
            self._shares.clear()

    def name_of(self, owner: str) -> str:
        """A tenant's key name (for its /metrics series), from the keys resolved here."""
        with self._lock:
            for _, answer in self._cache.values():
                if isinstance(answer, Tenant) and answer.id == owner:
                    return answer.name
        return owner

    # ------------------------------------------------------------------ limits
    def _limits(self, owner: str) -> tuple[float, int | None, str | None]:
        """(blocking on a cache miss) (weight, max_running, why its work may no longer run)."""
        now = time.monotonic()
        with self._lock:
            hit = self._shares.get(owner)
        if hit is not None and hit[0] > now:
            return hit[1]
        record = self.store.get(owner)
        if record is None:
            limits: tuple[float, int | None, str | None] = (1.0, None, None)
        else:
            barred = (f"key {record.name!r} ({record.prefix}…) was revoked" if record.revoked_at is not None
                      else None)
            limits = (record.weight, record.max_running, barred)
        with self._lock:
            self._shares[owner] = (now + SHARE_CACHE_S, limits)
        return limits

    def share(self, owner: str) -> tuple[float, int | None]:
        """(blocking on a cache miss) The tenant's fair-share weight and running limit."""
        return self._limits(owner)[:2]

    def barred(self, owner: str) -> str | None:
        """(blocking on a cache miss) Why the tenant's waiting work may not run any more (its key
        was revoked: at once on this replica, within SHARE_CACHE_S on the others), or None. Work
        accepted before an expiry still runs: an expiry ends new requests, not answers owed."""
        return self._limits(owner)[2]

    def rate(self, tenant: Tenant) -> dict[str, str]:
        """(blocking) One write request against the tenant's rate_per_minute: the RateLimit
        headers to send with it, or TooManyRequests. Every replica counts in the same row."""
        per_minute = tenant.key.rate_per_minute
        now = time.time()
        allowed, tat = self.store.take(tenant.id, per_minute, now)
        interval = 60.0 / per_minute
        policy = f'"write";q={per_minute:g};w=60'
        if not allowed:
            wait = max(1, math.ceil(tat - (60.0 - interval) - now))
            raise TooManyRequests(f"key {tenant.name!r} is over its rate_per_minute of {per_minute:g} write requests "
                                  f"a minute; retry in {wait} s", retry_after=wait, policy=policy,
                                  limit="rate_per_minute", value=per_minute)
        remaining = max(0, math.floor((now + 60.0 - interval - tat) / interval) + 1)
        return {"RateLimit-Policy": policy, "RateLimit": f'"write";r={remaining};t={max(0, math.ceil(tat - now))}'}

    def check_queued(self, tenant: Tenant, adding: int, count: int) -> None:
        """``adding`` more tasks (a sweep's or an evaluation's cells, or one task) on top of the
        ``count`` unfinished ones: TooManyRequests when that passes the tenant's max_queued."""
        limit = tenant.key.max_queued if tenant.key is not None else None
        if limit is None or count + adding <= limit:
            return
        raise TooManyRequests(f"key {tenant.name!r} has {count} unfinished task(s) and max_queued {limit}: "
                              f"{adding} more would pass it; retry once some have finished", retry_after=5,
                              policy=f'"queued";q={limit}', limit="max_queued", value=limit, unfinished=count)

    # ------------------------------------------------------------------ the admin's part
    def create(self, body: dict[str, Any]) -> tuple[KeyRecord, str]:
        scopes = list(dict.fromkeys(body.get("scopes") or DEFAULT_SCOPES))
        unknown = [s for s in scopes if s not in SCOPES]
        if unknown:
            raise InvalidRequest(f"scope(s) {', '.join(unknown)} are not known; the scopes are {', '.join(SCOPES)}",
                                 field="scopes")
        expires = body.get("expires_at")
        if expires is not None and expires <= time.time():
            raise InvalidRequest(f"expires_at {expires} is not in the future", field="expires_at")
        secret, prefix = new_secret()
        record = KeyRecord(id="k-" + uuid.uuid4().hex[:16], name=body["name"], prefix=prefix,
                           secret_sha256=digest(secret), previous_sha256=None, previous_until=None, scopes=scopes,
                           max_queued=body.get("max_queued"), max_running=body.get("max_running"),
                           rate_per_minute=body.get("rate_per_minute"), weight=float(body.get("weight") or 1.0),
                           expires_at=expires, created_at=time.time())
        return self.store.create(record), secret

    def get(self, key_id: str) -> KeyRecord:
        record = self.store.get(key_id)
        if record is None:
            raise NotFound(f"no key {key_id!r} here")
        return record

    def revoke(self, key_id: str) -> KeyRecord:
        self.get(key_id)
        record = self.store.revoke(key_id)
        self.forget()  # this replica: at once (the others: within CACHE_S)
        return record

    def rotate(self, key_id: str, grace_seconds: float | None) -> tuple[KeyRecord, str]:
        grace = GRACE_DEFAULT_S if grace_seconds is None else float(grace_seconds)
        if not 0 <= grace <= GRACE_MAX_S:
            raise InvalidRequest(f"grace_seconds must be in [0, {GRACE_MAX_S:g}] (7 days), got {grace_seconds}",
                                 field="grace_seconds")
        if self.get(key_id).revoked_at is not None:
            raise Forbidden(f"key {key_id} is revoked; a revoked key is not rotated (create a new one)")
        secret, prefix = new_secret()
        record = self.store.rotate(key_id, digest(secret), prefix, time.time() + grace)
        self.forget()
        return record, secret
