"""Request bodies: content types, the body-size limit, and multipart extraction.

The limit is enforced twice, before anything is parsed: on a declared
Content-Length, and by counting bytes while the body streams in (a chunked
upload has no Content-Length). Reading stops at the first byte over the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from ..errors import BadRequest, BodyTooLarge, InvalidRequest, UnsupportedMediaType

RAW_TYPES = ("application/octet-stream", "application/x-npz")
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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) a declared or streamed size over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length header {declared!r}") from None
        if size > limit:
            raise _too_large(limit, f"of {size} bytes (Content-Length)")
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise _too_large(limit, f"of more than {limit} bytes (counted while streaming)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequest("the client disconnected before the body was complete") from None
    return b"".join(chunks)


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
