"""app/allocator.py: rev88 serve's malloc thresholds, and an operator's own settings left alone.
Each case runs in a child process (mallopt changes the process it runs in)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from .server import ROOT

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def tune(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", "from app.runtime import allocator; print(allocator.tune())"],
                         cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@glibc
def test_glibc_gets_the_thresholds():
    assert tune({}) == "malloc keeps freed memory (mmap threshold 32 MiB, trim 128 MiB)"


@glibc
@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "1048576"), ("MALLOC_TRIM_THRESHOLD_", "0"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")])
def test_an_operators_own_setting_wins(name, value):
    assert tune({name: value}) == f"malloc left to {name}"


@glibc
def test_other_glibc_tunables_do_not_count():
    assert tune({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}).startswith("malloc keeps freed memory")


@glibc
def test_rev88_serve_applies_them_and_says_so(tmp_path):
    """A real ``rev88 serve``: its startup line names the malloc setting it made (the process is
    stopped once it has said so)."""
    from .server import free_port

    env = {**os.environ, "REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_DATA_DIR": str(tmp_path / "data")}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-m", "rev88", "serve", "--port", str(free_port())], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # the startup line comes before uvicorn starts
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it must stop on SIGTERM: fail, but leave no server behind
            proc.kill()
            proc.communicate(timeout=30)
            raise
    assert line.startswith("rev88 serve: http://127.0.0.1:"), line
    assert "malloc keeps freed memory (mmap threshold 32 MiB, trim 128 MiB)" in line
