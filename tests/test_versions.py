"""The framework release the HTTP shell was tested on (app/http/versions.py: uvicorn, whose
httptools protocol the body protocol subclasses): pinned in pyproject.toml, checked at start by
one gate (``protocol.refusal``, asked by create_app and rev88 serve), and on any other release
the service refuses to start (naming the package) unless REV88_STOCK_HTTP asks for uvicorn's own
protocol. FastAPI and Starlette are used through their public API only."""

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


def test_only_uvicorn_is_used_past_its_public_api():
    assert set(versions.TESTED) == {"uvicorn"}
    assert "protocol.py" in versions.TESTED["uvicorn"][1]


def test_an_untested_release_is_named_and_refused_by_the_one_gate(tmp_path, monkeypatch):
    monkeypatch.setitem(versions.TESTED, "uvicorn", (((0, 1),), "app/http/protocol.py subclasses its httptools protocol"))
    (line,) = versions.untested(("uvicorn",))
    assert line.startswith("uvicorn ") and "0.1.x" in line and "protocol.py" in line
    monkeypatch.setattr(protocol, "_PROBLEM", line)  # (what the module computes at import on such a release)
    refusal = protocol.refusal(stock_http=False)
    assert refusal.startswith(line) and "REV88_STOCK_HTTP=1" in refusal and "--stock-http" in refusal
    assert protocol.refusal(stock_http=True) is None
    with pytest.raises(RuntimeError, match="REV88_STOCK_HTTP") as refused:
        create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "a")))
    assert str(refused.value) == refusal
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "b"), stock_http=True))
    assert app is not None  # uvicorn's own protocol serves it; nothing of the app depends on the release


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
    assert "refusing to start: uvicorn 9.9.0" in err and "--stock-http" in err
    assert runs == []
    assert rev88_main([*args, "--stock-http"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "header timeout" in err and "lingering close" in err
    assert runs and runs[0]["http"] == "auto"  # uvicorn's own protocol
