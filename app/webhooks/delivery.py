"""Sending the outbox's messages (issue #34): every replica runs one ``Webhooks`` loop.

Each round (at least every REV88_WEBHOOK_POLL_S, sooner when this process records an event):

    promote   waiting messages whose event has happened get their type and body, once
              (app/ledger/outbox.py); a sweep's and an evaluation's state is read here
    claim     pending messages due now, leased for the timeout + 10 s, up to the free slots
              (REV88_WEBHOOK_CONCURRENCY)
    send      one attempt each: the URL resolved and every address checked again (the SSRF
              guard, app/webhooks/targets.py), one POST to a checked address with the Standard
              Webhooks headers (signed now, with the tenant's secrets), redirects never followed,
              at most REV88_WEBHOOK_TIMEOUT_S for the whole attempt, at most 64 KiB of the answer
              read; then the attempt and what comes next written under the lease.

Outcomes. 2xx: delivered. 410: stopped, and every later message of that tenant to that URL is
stopped without a request (until ``DELETE /webhooks/stopped``). Anything else -- another status
(3xx included), a connection error, a timeout, a refused address -- is retried on the schedule
(REV88_WEBHOOK_RETRY_SCHEDULE: the delay before each attempt, the first one's counted from the
event; ±10 % jitter), a 429's or 503's Retry-After honoured when it asks for longer (at most a
day); after the last attempt the message has failed. ``redeliver`` starts a message's schedule
again (same id, same body).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import math
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from ..ledger.outbox import Attempt, Message, open_outbox, subscription
from . import messages, signing, targets

log = logging.getLogger("rev88." + __name__)

READ_LIMIT = 64 * 1024  # bytes of a receiver's answer read at most
LEASE_MARGIN_S = 10.0
MAX_RETRY_AFTER_S = 86_400.0
OTHERS_EVERY_S = 2.0  # a waiting sweep's or evaluation's state is read at most this often (unless hinted)
PRUNE_EVERY_S = 600.0
STATS_EVERY_S = 5.0
CACHE_S = 1.0  # a tenant's secrets and stopped URLs are read again at most this often (another replica's
# rotation or 410 is seen within it; this replica's at once)
JITTER = 0.1
DEFAULT_SCHEDULE = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)  # Standard Webhooks'

Reader = Callable[[str], Awaitable[dict[str, Any] | None]]


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from ``now`` a Retry-After asks for (a number or an HTTP date); None without one."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


def describe_next(message: Message) -> str:
    """What happens next to a message, in words (the delivery log)."""
    state = message.state
    if state == "waiting":
        return f"waits for the {message.subject_kind}'s {message.event} event"
    if state == "pending":
        if message.next_at is None:
            return "sent soon"
        return f"attempt {message.round_attempts + 1} at {messages.iso(message.next_at)}"
    if state == "delivered":
        return "nothing: delivered"
    if state == "stopped":
        return "nothing: the receiver answered 410 Gone, deliveries to this URL are stopped for this tenant"
    if state == "failed":
        return "nothing: every attempt of the retry schedule failed (POST .../deliveries/redeliver to try again)"
    return f"nothing: skipped ({message.last_error})"


class Webhooks:
    """A replica's part of the webhooks: submissions' checks, secrets, the delivery log, and the
    delivery loop. ``readers``: subject kind -> async reader of a sweep's or an evaluation's
    document (None when it is gone)."""

    def __init__(self, ledger: Any, settings: Any, metrics: Any, readers: dict[str, Reader]) -> None:
        self.outbox = open_outbox(ledger)
        self.settings, self.metrics, self.readers = settings, metrics, readers
        self.schedule: tuple[float, ...] = tuple(settings.webhook_retry_schedule)
        self.timeout_s: float = settings.webhook_timeout_s
        self.allow = targets.parse_allow(settings.webhook_allow_cidrs)
        self.replica = getattr(ledger, "owner", None) or f"{socket.gethostname()}:{id(self):x}"
        self.concurrency: int = settings.webhook_concurrency
        self.poll_s: float = settings.webhook_poll_s
        self._wake: asyncio.Event | None = None
        self._hinted: set[str] = set()
        self._inflight: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None
        self._stopping = False
        self._last_prune = 0.0
        self._last_stats = 0.0
        self.stats: dict[str, Any] = {"states": {}, "oldest_pending_at": None}
        self._secrets: dict[str, tuple[float, tuple]] = {}  # owner -> (read at, its secrets)
        self._stopped: dict[str, tuple[float, dict[str, float]]] = {}  # owner -> (read at, url -> 410 time)
        self.database_error: str | None = None
        metrics.watch_webhooks(self._oldest_pending_s)

    # ------------------------------------------------------------------ submissions
    async def subscription(self, url: Any, events: Any, allowed: tuple[str, ...] = ("started", "completed"),
                           ) -> dict[str, Any] | None:
        """A request's webhook, checked (the URL's form, and every address its host resolves to
        now): the options' ``{"url", "events"}``; None without a URL. InvalidRequest-ready
        ValueErrors name the field (``webhook``, ``webhook_events``)."""
        if url is None:
            if events is not None:
                raise SubscriptionError("webhook_events needs a webhook URL", "webhook_events")
            return None
        names = parse_events(events, allowed)
        try:
            target = targets.parse(url)
            await asyncio.to_thread(targets.resolve, target, self.allow)
        except targets.TargetRefused as exc:
            raise SubscriptionError(str(exc), "webhook") from None
        return subscription(url, names)

    # ------------------------------------------------------------------ secrets, stopped URLs
    def secret(self, owner: str | None) -> dict[str, Any]:
        secret, _previous, until = self.outbox.secrets(owner or "", signing.new_secret)
        return {"key": secret, "previous_valid_until": until if until and until > time.time() else None}

    def rotate(self, owner: str | None) -> dict[str, Any]:
        self.outbox.rotate(owner or "", signing.new_secret(), self.settings.webhook_secret_overlap_s,
                           signing.new_secret)
        self._secrets.pop(owner or "", None)
        return self.secret(owner)

    def resume(self, owner: str | None, url: str) -> bool:
        self._stopped.pop(owner or "", None)
        return self.outbox.resume(owner or "", url)

    def signing_secrets(self, owner: str) -> list[str]:
        """The secrets that sign the tenant's messages now (read at most every CACHE_S)."""
        now = time.monotonic()
        cached = self._secrets.get(owner)
        if cached is None or now - cached[0] > CACHE_S:
            cached = self._secrets[owner] = (now, self.outbox.secrets(owner, signing.new_secret))
        secret, previous, until = cached[1]
        return [secret] + ([previous] if previous and until and until > time.time() else [])

    def stopped_at(self, owner: str, url: str) -> float | None:
        """When the tenant's URL answered 410 (None: not stopped); the list read at most every CACHE_S."""
        now = time.monotonic()
        cached = self._stopped.get(owner)
        if cached is None or now - cached[0] > CACHE_S:
            cached = self._stopped[owner] = (now, {r["url"]: r["stopped_at"] for r in self.outbox.stopped(owner)})
        return cached[1].get(url)

    # ------------------------------------------------------------------ the delivery log
    def log_of(self, kind: str, subject_id: str, owner: str | None = None) -> dict[str, Any]:
        """The subject's delivery log; ``owner`` (a tenant): its own messages only (None: all)."""
        out = []
        for m, attempts in self.outbox.messages_of(subject_id, owner):
            out.append({"id": m.id, "event": m.event, "type": m.type, "url": m.url, "state": m.state,
                        "created_at": m.created_at, "ready_at": m.ready_at,
                        "next_attempt_at": m.next_at if m.state == "pending" else None,
                        "finished_at": m.finished_at, "last_error": m.last_error, "next": describe_next(m),
                        "attempt_count": m.attempts, "attempts": [a.document() for a in attempts]})
        return {"kind": kind, "id": subject_id, "messages": out}

    def redeliver(self, subject_id: str, owner: str | None = None) -> list[str]:
        ids = self.outbox.redeliver(subject_id, owner)
        if ids:
            self.wake()
        return ids

    # ------------------------------------------------------------------ the loop
    def wake(self, subject_id: str | None = None) -> None:
        """Something happened here (a task recorded, a sweep's cell): look now, not at the next poll."""
        if subject_id is not None:
            self._hinted.add(subject_id)
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=self.timeout_s,
                                         limits=httpx.Limits(max_connections=self.concurrency,
                                                             max_keepalive_connections=0))
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="rev88-webhooks")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop claiming; attempts in flight get ``timeout_s`` to finish (the others' leases expire)."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._loop_task, timeout_s)
        if self._inflight:
            await asyncio.wait(list(self._inflight.values()), timeout=timeout_s)
        for task in list(self._inflight.values()):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                await self._promote()
                await self._claim()
                await self._upkeep()
                self.database_error = None
            except Exception as exc:  # noqa: BLE001 - a database away: the next round tries again
                self.database_error = str(exc)
                log.warning("webhook round failed", extra={"error": str(exc)[:300]})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _promote(self) -> None:
        first = self.schedule[0]
        due = []
        for row in await asyncio.to_thread(self.outbox.due_tasks, 200):
            event = messages.task_event(row)
            if isinstance(event, str):
                await asyncio.to_thread(self.outbox.skip, row[0], event)
            else:
                due.append((row[0], *event))
        if due:  # one transaction for every task event this round
            await asyncio.to_thread(self.outbox.promote_many, due, first)
        hinted, self._hinted = self._hinted, set()
        others = [] if not self.readers else await asyncio.to_thread(
            self.outbox.waiting_others, 50, time.time() - OTHERS_EVERY_S)
        for subject in hinted:
            if subject.startswith(("sw-", "ev-")):
                others += [(m, "sweep" if subject.startswith("sw-") else "evaluation", subject)
                           for m in await asyncio.to_thread(self.outbox.waiting_of, subject)]
        seen: dict[str, Any] = {}
        for message_id, kind, subject_id in others:
            if subject_id not in seen:
                reader = self.readers.get(kind)
                seen[subject_id] = None if reader is None else await reader(subject_id)
            doc = seen[subject_id]
            if doc is None:
                await asyncio.to_thread(self.outbox.skip, message_id, f"{kind} {subject_id} is gone")
                continue
            event = (messages.sweep_event if kind == "sweep" else messages.evaluation_event)(doc)
            if event is not None:
                await asyncio.to_thread(self.outbox.promote, message_id, event[0], event[1], event[2], first)

    async def _claim(self) -> None:
        free = self.concurrency - len(self._inflight)
        if free <= 0 or self._stopping:
            return
        claimed = await asyncio.to_thread(self.outbox.claim, self.replica, free, self.timeout_s + LEASE_MARGIN_S)
        for m in claimed:
            task = asyncio.get_running_loop().create_task(self._deliver(m), name=f"rev88-webhook-{m.id}")
            self._inflight[m.id] = task
            task.add_done_callback(lambda _t, mid=m.id: self._done(mid))

    def _done(self, message_id: str) -> None:
        self._inflight.pop(message_id, None)
        if self._wake is not None:
            self._wake.set()  # a slot is free: claim again

    async def _upkeep(self) -> None:
        now = time.time()
        if now - self._last_stats >= STATS_EVERY_S:
            self._last_stats = now
            self.stats = await asyncio.to_thread(self.outbox.stats)
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            await asyncio.to_thread(self.outbox.prune, now - self.settings.webhook_retain_s)

    def _oldest_pending_s(self) -> float:
        oldest = self.stats.get("oldest_pending_at")
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    # ------------------------------------------------------------------ one attempt
    async def _deliver(self, m: Message) -> None:
        try:
            await self._attempt(m)
        except Exception as exc:  # noqa: BLE001 - its lease expires and the attempt is made again
            log.error("webhook attempt not recorded", extra={"message_id": m.id, "error": str(exc)[:300]})

    async def _attempt(self, m: Message) -> None:
        now = time.time()
        attempt = Attempt(n=0, at=now, url=m.url, address=None, status_code=None, duration_ms=None, error=None,
                          outcome="", next_at=None, replica=self.replica)
        stopped = await asyncio.to_thread(self.stopped_at, m.owner, m.url)
        if stopped is not None:
            attempt.error = (f"not sent: this URL answered 410 Gone at {messages.iso(stopped)}; "
                             "deliveries to it are stopped for this tenant (DELETE /webhooks/stopped?url=... resumes)")
            attempt.outcome = "stopped"
            await self._record(m, attempt, "stopped")
            return
        retry_after = None
        secrets_ = await asyncio.to_thread(self.signing_secrets, m.owner)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole attempt: lookup, connect, send, read
                target = await asyncio.to_thread(targets.resolve, targets.parse(m.url), self.allow)
                attempt.address, attempt.status_code, retry_header = await self._post(target, m, secrets_)
            retry_after = parse_retry_after(retry_header, time.time()) if attempt.status_code in (429, 503) else None
        except targets.TargetRefused as exc:
            attempt.error = f"not sent: {exc}"
        except TimeoutError:
            attempt.error = f"timed out after {self.timeout_s:g} s (REV88_WEBHOOK_TIMEOUT_S)"
        except Exception as exc:  # noqa: BLE001 - connection errors, TLS, a malformed answer: logged, retried
            attempt.error = f"{type(exc).__name__}: {exc}"[:500]
        attempt.duration_ms = round((time.perf_counter() - t0) * 1000, 3)
        code = attempt.status_code
        if code is not None and 200 <= code < 300:
            attempt.outcome, state = "delivered", "delivered"
        elif code == 410:
            attempt.outcome, state = "stopped", "stopped"
            attempt.error = "the receiver answered 410 Gone: deliveries to this URL are stopped for this tenant"
        else:
            if code is not None:
                attempt.error = (f"answered {code}" + (" (redirects are not followed)" if 300 <= code < 400 else ""))
            made = m.round_attempts + 1
            if made < len(self.schedule):
                delay = self.schedule[made] * random.uniform(1 - JITTER, 1 + JITTER)
                if retry_after is not None:
                    delay = max(delay, retry_after)
                attempt.next_at = time.time() + delay
                attempt.outcome, state = "retry", "pending"
            else:
                attempt.outcome, state = "failed", "failed"
        await self._record(m, attempt, state)
        if state == "stopped" and code == 410:
            await asyncio.to_thread(self.outbox.stop, m.owner, m.url, m.id)
            self._stopped.pop(m.owner, None)

    async def _record(self, m: Message, attempt: Attempt, state: str) -> None:
        recorded = await asyncio.to_thread(self.outbox.record, m, self.replica, attempt, state)
        self.metrics.webhook_delivery(attempt.outcome if recorded else "lease_lost")
        if not recorded:
            log.warning("webhook attempt's lease lost; another replica holds the message", extra={"message_id": m.id})

    async def _post(self, target: targets.Target, m: Message, secrets_: list[str]) -> tuple[str, int, str | None]:
        """One POST to the first checked address that accepts the connection: (address, status,
        Retry-After). At most READ_LIMIT bytes of the answer are read."""
        headers = {"host": target.host_header, "content-type": "application/json",
                   "user-agent": "rev88-webhooks/1", **signing.headers(secrets_, m.id, int(time.time()), m.body)}
        extensions = {}
        if target.scheme == "https" and target.host not in target.addresses:
            extensions["sni_hostname"] = target.host  # TLS names and verifies the host, not the address
        last: Exception | None = None
        for address in target.addresses:
            try:
                async with self._client.stream("POST", target.url_for(address), content=m.body, headers=headers,
                                               extensions=extensions) as response:
                    read = 0
                    async for chunk in response.aiter_raw():
                        read += len(chunk)
                        if read >= READ_LIMIT:
                            break
                    return address, response.status_code, response.headers.get("retry-after")
            except httpx.ConnectError as exc:
                last = exc
        raise last or httpx.ConnectError("no address to connect to")


class SubscriptionError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


def parse_events(events: Any, allowed: tuple[str, ...]) -> list[str]:
    """``webhook_events``: a comma list (query) or a list (JSON) of event names; default completed."""
    if events is None:
        return ["completed"]
    names = [e.strip() for e in events.split(",")] if isinstance(events, str) else events
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise SubscriptionError(f"webhook_events must name one or more of {', '.join(allowed)}", "webhook_events")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SubscriptionError(f"webhook_events {', '.join(unknown)} unknown here; allowed: {', '.join(allowed)}",
                                "webhook_events")
    return sorted(set(names), key=names.index)
