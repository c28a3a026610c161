"""Request bodies: content types, the body-size limit, the upload deadline and memory, multipart.

The size limit is enforced twice, before anything is parsed: on a declared Content-Length, and
by counting bytes while the body streams in (a chunked upload has no Content-Length). Reading
stops at the first byte over the limit.

Slow uploads cannot hold the service: a body must arrive by its deadline (REV88_UPLOAD_TIMEOUT_S,
plus a second per REV88_UPLOAD_MIN_RATE bytes it declares), else it is answered 408 and its
connection closed. Nothing is reserved for an upload before its bytes arrive: the bodies being
received or parsed are bounded by the bytes they hold (``UploadBudget``), so a thousand
connections trickling a byte at a time hold a few kilobytes, not the upload slots a real
upload needs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from ..errors import BadRequest, BodyTooLarge, InvalidRequest, QueueFull, UnsupportedMediaType, UploadTimeout

RAW_TYPES = ("application/octet-stream", "application/x-npz")
BODY = "rev88.body"  # scope key: a body the protocol reads into one buffer (app/http/protocol.py)
MULTIPART = "multipart/form-data"
ACCEPTED_TYPES = (*RAW_TYPES, MULTIPART)
FORM_FIELDS = ("file", "config")


def media_type(content_type: str | None) -> str:
    """``"Multipart/Form-Data; boundary=x"`` -> ``"multipart/form-data"``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def check_content_type(content_type: str | None) -> str:
    kind = media_type(content_type)
    if kind not in ACCEPTED_TYPES:
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise UnsupportedMediaType(
            f"unsupported content type: got {got}; send the task npz as "
            f"{' or '.join(RAW_TYPES)}, or as multipart/form-data field 'file'",
            accepted=list(ACCEPTED_TYPES),
        )
    return kind


def _too_large(limit: int, seen: str) -> BodyTooLarge:
    return BodyTooLarge(f"request body {seen} exceeds the limit of {limit} bytes (REV88_MAX_BODY_BYTES)", limit=limit)


class UploadBudget:
    """The bytes that request bodies being received or parsed may hold together (thread-safe).
    Each request reserves what it has received, as it arrives, and gives it back once its body
    is released (``Reservation.release``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.uploads = 0  # requests holding a reservation
        self._lock = threading.Lock()

    def reservation(self) -> Reservation:
        return Reservation(self)

    def take(self, reservation: Reservation, n: int) -> bool:
        """``n`` more bytes for ``reservation`` if they fit (its first bytes count one more upload);
        False, taking nothing, if they do not."""
        with self._lock:
            if self.held + n > self.capacity:
                return False
            self.held += n
            if not reservation.open:
                reservation.open = True
                self.uploads += 1
        reservation.bytes += n
        return True

    def release(self, reservation: Reservation) -> None:
        """Everything ``reservation`` holds back to the budget."""
        with self._lock:
            self.held -= reservation.bytes
            if reservation.open:
                self.uploads -= 1
        reservation.bytes, reservation.open = 0, False


class Reservation:
    """One request's bytes in the budget (``open``: it holds some, counted as an upload)."""

    def __init__(self, budget: UploadBudget) -> None:
        self.budget, self.bytes, self.open = budget, 0, False

    def take(self, n: int) -> bool:
        return self.budget.take(self, n)

    def release(self) -> None:
        self.budget.release(self)


def budget_full(budget: UploadBudget) -> QueueFull:
    """The 503 for a body the upload budget cannot hold now."""
    return QueueFull(f"too much upload data in progress ({budget.held} bytes in {budget.uploads} uploads; "
                     f"limit {budget.capacity}: REV88_UPLOAD_BUFFER_BYTES); retry later", retry_after=2)


def upload_deadline_s(declared: int | None, timeout_s: float, min_rate: int) -> float:
    """Seconds a body may take: the timeout, plus a second per ``min_rate`` bytes declared."""
    return timeout_s + (declared or 0) / min_rate


async def read_body(request: Request, limit: int, *, timeout_s: float = 60.0, min_rate: int = 1 << 20,
                    reservation: Reservation | None = None) -> bytes | memoryview:
    """The whole body, refusing (413) a declared or streamed size over ``limit`` or a declared one
    the upload budget could never hold, (408) a body that has not arrived by its deadline, and
    (503) one the upload budget cannot hold now. Its bytes are reserved as they arrive (a body
    the protocol reads into one buffer, app/http/protocol.py, is reserved there)."""
    declared = request.headers.get("content-length")
    size = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length header {declared!r}") from None
        if size > limit:
            raise _too_large(limit, f"of {size} bytes (Content-Length)")
        if reservation is not None and size > reservation.budget.capacity:
            capacity = reservation.budget.capacity
            raise BodyTooLarge(f"request body of {size} bytes (Content-Length) exceeds what the upload buffer can "
                               f"ever hold, {capacity} bytes (REV88_UPLOAD_BUFFER_BYTES)", limit=capacity)
    deadline = upload_deadline_s(size, timeout_s, min_rate)
    chunks: list[bytes] = []
    received = 0
    try:
        async with asyncio.timeout(deadline):
            async for chunk in _stream(request):
                received += len(chunk)
                if received > limit:
                    raise _too_large(limit, f"of more than {limit} bytes (counted while streaming)")
                if reservation is not None and BODY not in request.scope \
                        and not reservation.take(len(chunk)):  # (a body read whole is reserved already)
                    raise budget_full(reservation.budget)
                chunks.append(chunk)
    except TimeoutError:
        whole = request.scope.get(BODY)  # (a body read into one buffer: the bytes it holds)
        received = max(received, getattr(whole, "pos", 0))
        of = f" of {size}" if size is not None else ""
        raise UploadTimeout(
            f"the request body did not arrive in time: {received}{of} bytes in {deadline:.4g} s "
            f"(REV88_UPLOAD_TIMEOUT_S {timeout_s:g} s plus 1 s per REV88_UPLOAD_MIN_RATE {min_rate} bytes declared)",
            received=received, deadline_s=round(deadline, 3)) from None
    except ClientDisconnect:
        raise BadRequest("the client disconnected before the body was complete") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _stream(request: Request):
    """The body's chunks as they arrive (Starlette's ``Request.stream``); a body the protocol read
    straight into its buffer comes as one memoryview (app/http/protocol.py)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body", False):
            return


async def _one_chunk(body: bytes):
    yield body


async def split_multipart(headers: Headers, body: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """(npz bytes of field ``file``, the ``config`` field parsed as a JSON object or None)."""
    parser = MultiPartParser(headers, _one_chunk(body), max_files=4, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"malformed multipart/form-data body: {exc.message}") from None
    try:
        names = list(form.keys())
        unexpected = sorted(set(names) - set(FORM_FIELDS))
        if unexpected:
            raise InvalidRequest(
                f"unexpected multipart field(s): {', '.join(unexpected)}; allowed are 'file' (the task npz) "
                "and 'config' (a JSON object of config overrides)"
            )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InvalidRequest(f"multipart field(s) given more than once: {', '.join(repeated)}")
        upload = form.get("file")
        if upload is None:
            raise InvalidRequest("multipart body has no 'file' field holding the task npz")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("multipart field 'file' must be a file part (with a filename), not a text field")
        data = await upload.read()
        config = form.get("config")
        if config is None:
            return data, None
        if isinstance(config, UploadFile):
            config = (await config.read()).decode("utf-8", "replace")
        try:
            parsed = json.loads(config)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"multipart field 'config' is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("multipart field 'config' must be a JSON object of config keys")
        return data, parsed
    finally:
        await form.close()
