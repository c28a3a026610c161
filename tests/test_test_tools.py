"""`make test` on a fresh machine (issue 43, item 6): scripts/test_tools.sh installs Debian's
chromium and postgresql when the tests require them and they are missing -- as root, or through
`sudo -n` -- and otherwise stops before the suite with the one command to run. Driven here with a
stub apt-get (it logs its arguments and "installs" by creating the binaries), a stub id and sudo,
on a PATH that holds nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test_tools.sh"

APT = """#!/bin/bash
echo "apt-get $*" >> "$STUB_LOG"
[ "$1" = update ] && exit 0
[ -n "${STUB_APT_FAILS:-}" ] && { echo "E: stub apt fails" >&2; exit 100; }
for pkg in "$@"; do
  case "$pkg" in
    chromium) printf '#!/bin/bash\\n' > "$STUB_BIN/chromium"; chmod +x "$STUB_BIN/chromium" ;;
    postgresql) mkdir -p "$STUB_PG/15/bin"; printf '#!/bin/bash\\n' > "$STUB_PG/15/bin/initdb"; chmod +x "$STUB_PG/15/bin/initdb" ;;
  esac
done
"""
SUDO = """#!/bin/bash
[ -n "${STUB_SUDO_OK:-}" ] || { echo "sudo: a password is required" >&2; exit 1; }
[ "$1" = -n ] && shift
echo "sudo $*" >> "$STUB_LOG"
[ "$1" = true ] && exit 0
exec "$@"
"""


@pytest.fixture
def stub(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("ls", "mkdir", "chmod", "env", "cat"):
        os.symlink(shutil.which(tool), bin_ / tool)
    for name, text in (("apt-get", APT), ("sudo", SUDO)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")

    def run(uid: int = 0, have: tuple[str, ...] = (), require: str = "postgres,browser", **extra):
        (bin_ / "id").write_text(f"#!/bin/bash\necho {uid}\n")
        (bin_ / "id").chmod(0o755)
        if "chromium" in have:
            (bin_ / "chromium").write_text("#!/bin/bash\n")
            (bin_ / "chromium").chmod(0o755)
        if "postgresql" in have:
            (tmp_path / "pg" / "15" / "bin").mkdir(parents=True, exist_ok=True)
            (tmp_path / "pg" / "15" / "bin" / "initdb").write_text("")
        env = {"PATH": str(bin_), "STUB_LOG": str(log), "STUB_BIN": str(bin_), "STUB_PG": str(tmp_path / "pg"),
               "PG_INITDB_GLOB": str(tmp_path / "pg" / "*" / "bin" / "initdb"), "REV88_TEST_REQUIRE": require, **extra}
        proc = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
        return proc, log.read_text().splitlines()

    return run


def test_nothing_to_do_when_both_are_there(stub):
    proc, calls = stub(uid=1000, have=("chromium", "postgresql"))
    assert proc.returncode == 0 and calls == [] and proc.stderr == ""


def test_root_installs_what_is_missing(stub):
    proc, calls = stub(uid=0, have=("chromium",))
    assert proc.returncode == 0, proc.stderr
    assert calls == ["apt-get update -qq", "apt-get install -y --no-install-recommends postgresql"]
    proc, calls = stub(uid=0)  # now both are there: nothing more
    assert proc.returncode == 0 and len(calls) == 2


def test_a_user_with_sudo_installs_through_it(stub):
    proc, calls = stub(uid=1000, STUB_SUDO_OK="1")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["sudo true", "sudo apt-get update -qq", "apt-get update -qq",
                     "sudo apt-get install -y --no-install-recommends chromium postgresql",
                     "apt-get install -y --no-install-recommends chromium postgresql"]


def test_a_user_without_sudo_is_told_the_one_command(stub):
    proc, calls = stub(uid=1000)
    assert proc.returncode == 1 and calls == []
    assert ("sudo apt-get update && sudo apt-get install -y --no-install-recommends chromium postgresql"
            in proc.stderr)
    assert "make test TEST_REQUIRE=" in proc.stderr


def test_only_what_the_tests_require(stub):
    proc, calls = stub(uid=0, require="")
    assert proc.returncode == 0 and calls == []
    proc, calls = stub(uid=0, require="browser")
    assert proc.returncode == 0 and calls[-1] == "apt-get install -y --no-install-recommends chromium"


def test_a_failed_install_stops_before_the_suite(stub):
    proc, calls = stub(uid=0, STUB_APT_FAILS="1")
    assert proc.returncode == 1 and "failed" in proc.stderr and "make test TEST_REQUIRE=" in proc.stderr


def test_make_test_runs_it_before_the_suite():
    makefile = (ROOT / "Makefile").read_text()
    assert "test: install-test test-tools\n" in makefile
    assert "REV88_TEST_REQUIRE=$(TEST_REQUIRE) bash scripts/test_tools.sh" in makefile
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
