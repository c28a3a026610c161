"""The framework releases the service was tested on, where it uses their private parts.

The body protocol (app/http/protocol.py) subclasses uvicorn's httptools protocol and uses its
private attributes; the POST /tasks entry (app/api/hot_path.py) goes past FastAPI's layers, reads
FastAPI's private telemetry switch and calls the app's exception handlers as Starlette's middleware
would. pyproject.toml pins the same ranges, and CI runs the tests on them. On any other release
the service does not guess: ``rev88 serve`` and ``create_app`` refuse to start, naming the
package, unless told to run without those parts (REV88_STOCK_HTTP, ``rev88 serve --stock-http``).
"""

from __future__ import annotations

from importlib import metadata

# package -> the (major, minor) releases tested, and what uses its private parts
TESTED = {
    "uvicorn": (((0, 55),), "app/http/protocol.py subclasses its httptools protocol"),
    "fastapi": (((0, 165),), "app/api/hot_path.py serves POST /tasks past its layers"),
    "starlette": (((1, 10),), "app/api/hot_path.py calls the exception handlers as its middleware does"),
}


# what REV88_STOCK_HTTP runs without (rev88 serve prints it; the app logs it)
STOCK_HTTP_LOST = (
    "REV88_STOCK_HTTP: uvicorn's own HTTP protocol and FastAPI's own layers for POST /tasks. Lost: the header "
    "timeout (a connection that never finishes its headers stays open), the lingering close after an answer "
    "given before its body was read (the connection reads the body on), a large body read into one buffer and "
    "reserved in the upload budget as it arrives (uploads are counted only as the app reads them), a bad "
    "request's 400 held behind the answers pipelined before it, a client's disconnect seen without a task "
    "per waiting request")


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
