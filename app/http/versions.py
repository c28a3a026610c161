"""The framework releases the service was tested on, where it uses their private parts.

The body protocol (app/http/protocol.py) subclasses uvicorn's httptools protocol and uses its
private attributes; nothing else in the service uses a private part of uvicorn, FastAPI or
Starlette. pyproject.toml pins the same range, and CI runs the tests on it. On any other release
the service does not guess: the release gate (``protocol.refusal``, asked by ``create_app`` and
``rev88 serve``) refuses to start, naming the package, unless told to run without the body
protocol (REV88_STOCK_HTTP, ``rev88 serve --stock-http``).

(Loaded by its path, alone, by scripts/gpu_carried.py: it imports nothing of the service.)
"""

from __future__ import annotations

from importlib import metadata

# package -> the (major, minor) releases tested, and what uses its private parts
TESTED = {
    "uvicorn": (((0, 55),), "app/http/protocol.py subclasses its httptools protocol"),
}


# what REV88_STOCK_HTTP runs without (rev88 serve prints it; the app logs it)
STOCK_HTTP_LOST = (
    "REV88_STOCK_HTTP: uvicorn's own HTTP protocol instead of the body protocol. Lost: the header "
    "timeout (a connection that never finishes its headers stays open), the lingering close after an answer "
    "given before its body was read (the connection reads the body on), a large body read into one buffer and "
    "reserved in the upload budget as it arrives (uploads are counted only as the app reads them), a bad "
    "request's 400 held behind the answers pipelined before it, a client's disconnect seen without a task "
    "per waiting request, a request that offers an Upgrade served with its body (curl --http2: uvicorn's own "
    "drops the body)")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def untested(names=tuple(TESTED)) -> list[str]:
    """One line per package of ``names`` whose installed release is not one tested."""
    out = []
    for name in names:
        releases, use = TESTED[name]
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name} is not installed ({use})")
            continue
        if _release(found) not in releases:
            tested = ", ".join(".".join(map(str, r)) + ".x" for r in releases)
            out.append(f"{name} {found} is not the release tested ({tested}): {use}")
    return out
