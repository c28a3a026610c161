"""Every exception a route lets through becomes the JSON error body of app/errors.py's
``error_answer`` -- the same mapping the task runner uses for a failed task. A request that does
not validate is told, in words, which field is wrong and what it must be (``validation_text``);
a path no route serves gets a hint where the routes are listed."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from learner.backends import BackendUnavailable
from learner.config import nearest
from learner.errors import TaskError

from ..errors import ServiceError, error_answer, json_safe
from ..http.logs import request_id_var
from ..ledger import LedgerUnavailable


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    status, body, headers = error_answer(exc, _request_id(request))
    return JSONResponse(body, status_code=status, headers=headers)


def _allowed(request: Request) -> str:
    """Every method the app's routes serve at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):  # (an included router's routes too)
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(request.url.path):
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything no other handler takes: a 500, logged with its traceback. Starlette calls this one
    from its outermost layer (ServerErrorMiddleware), outside the request middleware
    (app/http/middleware.py), so the log line's request id and the X-Request-ID header are set
    here. Starlette then raises the exception on to uvicorn, which closes the connection: the
    answer says so (``Connection: close``), so that a client does not send its next request on it."""
    rid = _request_id(request)
    token = request_id_var.set(rid)
    try:
        response = await _any_error(request, exc)
    finally:
        request_id_var.reset(token)
    if rid is not None:
        response.headers["X-Request-ID"] = rid
    response.headers["Connection"] = "close"
    return response


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed(request)
    body: dict[str, Any] = {"error": str(exc.detail)}
    if exc.status_code == 404:
        root = request.scope.get("root_path", "").rstrip("/")
        body["hint"] = (f"{request.method} {request.url.path} is not a route of this service: its routes are listed "
                        f"at {root}/docs ({root}/openapi.json), the web page is at {root}/")
    return JSONResponse({**body, "request_id": _request_id(request)}, status_code=exc.status_code, headers=headers)


# --------------------------------------------------------------------------- validation errors, in words

# The patterns the API's fields and parameters are checked against, as a reader would say them
# (tests/test_api_errors.py: every pattern of the OpenAPI document has its words here)
PATTERN_WORDS = {
    r"^sha256:[0-9a-f]{64}$": "sha256:<64 lowercase hex digits> (the SHA-256 of the npz bytes)",
    "^[A-Za-z0-9_-]+$": "the next_cursor of the previous page as it was given (letters, digits, - and _)",
    r"^[A-Za-z0-9 ._@:-]+$": "letters, digits, spaces and . _ @ : - only",
    "^(started|completed)(,(started|completed))*$": "started, completed, or started,completed",
    "^[\\x21-\\x7e]+$": "printable ASCII without spaces",
}
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
# (a union's members are reported under a tag of the member's type: not a field's name)
_UNION_TAG = re.compile(r"(int|float|str|bool|bytes|none|(list|dict|tuple|set|frozenset|literal)\[.*\]"
                        r"|function-\w+\[.*\]|[A-Z]\w*(\[.*\])?)")


_TYPE_ERRORS = {"list_type", "tuple_type", "set_type", "dict_type", "model_type", "model_attributes_type", "int_type",
                "float_type", "string_type", "bool_type"}


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 48 else text[:36] + "…" + text[-8:]


def _must(error: dict) -> str:
    """What the value must be, in words, from one pydantic error."""
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    words = {
        "missing": "is required",
        "extra_forbidden": "is not a field of this request",
        "list_type": "must be a list", "tuple_type": "must be a list", "set_type": "must be a list",
        "dict_type": "must be a JSON object", "model_type": "must be a JSON object",
        "model_attributes_type": "must be a JSON object",
        "int_type": "must be a whole number", "int_parsing": "must be a whole number",
        "int_from_float": "must be a whole number", "float_type": "must be a number",
        "float_parsing": "must be a number", "finite_number": "must be a finite number",
        "string_type": "must be a string", "bool_type": "must be true or false", "bool_parsing": "must be true or false",
        "none_required": "must be null",
    }
    if kind in words:
        return words[kind]
    bounds = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "more than"),
              "less_than_equal": ("le", "at most"), "less_than": ("lt", "less than")}
    if kind in bounds and bounds[kind][0] in ctx:
        return f"must be {bounds[kind][1]} {ctx[bounds[kind][0]]}"
    if kind in ("string_too_short", "string_too_long"):
        n = ctx.get("min_length" if kind.endswith("short") else "max_length")
        return f"must have {'at least' if kind.endswith('short') else 'at most'} {plural(n, 'character')}"
    if kind in ("too_short", "too_long"):
        n = ctx.get("min_length" if kind.endswith("short") else "max_length")
        return f"must hold {'at least' if kind.endswith('short') else 'at most'} {plural(n, 'item')}"
    if kind in ("literal_error", "enum") and "expected" in ctx:
        return f"must be {ctx['expected']}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        said = PATTERN_WORDS.get(pattern)
        text = f"must be {said}" if said else f"must match {pattern}"
        value = error.get("input")
        if isinstance(value, str) and _HEX64.fullmatch(value) and "sha256:" in pattern:
            text += f": did you mean sha256:{value.lower()}?"
        return text
    msg = str(error.get("msg", "is not valid"))
    return msg.replace("Input should be", "must be").replace("Value error, ", "")


def _unwrap(annotation: Any) -> Any:
    """The model inside ``X | None`` (or the annotation itself)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                return arg
    return annotation


def _field_names(request: Request, loc: tuple) -> tuple[list[str], str | None]:
    """The fields of the JSON object that holds ``loc``'s last part, and the description of that
    part where it is a model's field ([] and None where the body is not a model there)."""
    route = request.scope.get("route")
    body = getattr(route, "body_field", None)
    model = _unwrap(getattr(getattr(body, "field_info", None), "annotation", None))
    parts = [p for p in loc[1:] if not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]
    for part in parts[:-1]:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return [], None
        model = _unwrap(fields[part].annotation)
    fields = getattr(model, "model_fields", None) or {}
    last = parts[-1] if parts else None
    described = fields[last].description if last in fields else None
    return list(fields), described


def _where(loc: tuple) -> str:
    """``grid.learning_rate[0]``, ``query parameter limit``, ``digest (in the path)``."""
    section, parts = (loc[0], loc[1:]) if loc and loc[0] in ("body", "query", "path", "header", "cookie") else ("", loc)
    name = ""
    for part in parts:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _UNION_TAG.fullmatch(str(part)):
            name += ("." if name else "") + str(part)
    if section == "query":
        return f"query parameter {name}"
    if section == "path":
        return f"{name} (in the path)"
    if section in ("header", "cookie"):
        return f"{section} {name}"
    return name or "the body"


def validation_text(request: Request, errors: list[dict]) -> str:
    """One sentence per wrong field: which, what it must be, what it was (a union's members said
    together: "must be a list or a JSON object")."""
    grouped: dict[str, list[dict]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            ctx = error.get("ctx") or {}
            return f"the request is not valid JSON ({ctx.get('error', 'cannot be parsed')})"
        grouped.setdefault(_where(tuple(error.get("loc", ()))), []).append(error)
    for where in list(grouped):  # a union member's wrong type, where another member got further: that one
        if all(e.get("type") in _TYPE_ERRORS for e in grouped[where]) and any(
                other.startswith((where + ".", where + "[")) for other in grouped):
            del grouped[where]
    sentences = []
    for where, group in grouped.items():
        musts = list(dict.fromkeys(_must(e) for e in group))
        if "must be a number" in musts and "must be a whole number" in musts:
            musts.remove("must be a whole number")
        if len(musts) > 1 and all(m.startswith("must be ") for m in musts):
            said = "must be " + " or ".join(m[len("must be "):] for m in musts)
        else:
            said = "; or ".join(musts)
        first = group[0]
        loc = tuple(first.get("loc", ()))
        fields, described = _field_names(request, loc) if loc and loc[0] == "body" else ([], None)
        if first.get("type") == "extra_forbidden":
            near = nearest(str(loc[-1]), fields) if fields else None
            said += f" (did you mean {near}?)" if near else (f"; its fields: {', '.join(fields)}" if fields else "")
        elif first.get("type") != "missing" and "did you mean" not in said:
            if described and len(musts) > 1:
                said += f" ({described})"
            said += f", got {_shown(first.get('input'))}"
        sentences.append(f"{where} {said}")
    return "; ".join(sentences)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    body = {"error": f"invalid request: {validation_text(request, exc.errors())}", **json_safe({"details": exc.errors()}),
            "request_id": _request_id(request)}
    return JSONResponse(body, status_code=422)


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for known in (ServiceError, TaskError, BackendUnavailable, LedgerUnavailable):
        app.add_exception_handler(known, _any_error)
    app.add_exception_handler(Exception, _unexpected)  # anything else: 500, logged (Starlette re-raises it after)
