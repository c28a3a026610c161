"""The framework releases the HTTP shell was tested on (app/http/versions.py): pinned in
pyproject.toml, checked at start, and on any other release the service refuses to start (naming
the package) unless REV88_STOCK_HTTP asks for uvicorn's own protocol and FastAPI's own layers."""

from __future__ import annotations

import re
import tomllib

import pytest

from app.http import protocol, versions
from app.main import create_app
from app.settings import Settings
from rev88.cli import main as rev88_main

from .helpers import ROOT


def test_the_installed_releases_are_the_tested_ones():
    assert versions.untested() == []
    assert protocol.problem() is None and protocol.protocol_class() is not None


def test_pyproject_pins_exactly_the_tested_releases():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, (releases, _) in versions.TESTED.items():
        (spec,) = [d for d in deps if re.match(rf"^{name}(\[[^\]]*\])?[<>=]", d)]
        (major, minor), = releases  # one tested release line each
        assert re.sub(r"\[[^\]]*\]", "", spec) == f"{name}>={major}.{minor},<{major}.{minor + 1}", spec


def test_an_untested_framework_release_is_named_and_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(versions.TESTED, "fastapi", (((0, 1),), "app/api/hot_path.py serves POST /tasks past its layers"))
    (line,) = versions.untested(("fastapi",))
    assert line.startswith("fastapi ") and "0.1.x" in line and "hot_path.py" in line
    with pytest.raises(RuntimeError, match="REV88_STOCK_HTTP"):
        create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "a")))
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "b"), stock_http=True))
    assert app.hot is None  # POST /tasks through FastAPI's own layers


def test_rev88_serve_refuses_to_start_without_the_protocol_and_says_why(tmp_path, monkeypatch, capsys):
    import uvicorn

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: runs.append(kw))  # (never serve in the test)
    monkeypatch.setattr(protocol, "_PROBLEM", "uvicorn 9.9.0 is not the release tested (0.55.x): ...")
    for name, value in (("REV88_BACKEND", "cpu"), ("REV88_WORKERS", "1"), ("REV88_DATA_DIR", str(tmp_path / "d")),
                        ("REV88_STOCK_HTTP", "0")):  # (rev88 serve writes its flags into os.environ: restored after)
        monkeypatch.setenv(name, value)
    args = ["serve", "--backend", "cpu", "--workers", "1", "--data-dir", str(tmp_path / "d")]
    assert rev88_main(args) != 0
    err = capsys.readouterr().err
    assert "refusing to start" in err and "uvicorn 9.9.0" in err and "--stock-http" in err
    assert runs == []
    assert rev88_main([*args, "--stock-http"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "header timeout" in err and "lingering close" in err
    assert runs and runs[0]["http"] == "auto"  # uvicorn's own protocol
