#!/usr/bin/env bash
# What `make test` needs beyond Python, installed before the suite runs (`make test`, .ci/run):
# Debian's chromium (the web page's real-browser tests) and postgresql (its server binaries: the
# ledger's PostgreSQL tests start throwaway servers). Which are needed follows REV88_TEST_REQUIRE
# (postgres, browser, all; `make test` sets postgres,browser): with it empty, nothing is needed and
# those tests skip.
#
#   - everything there: nothing to do
#   - something missing, and this may install (root, or `sudo -n` works): apt-get update, then
#     apt-get install -y --no-install-recommends <the missing packages>
#   - something missing, and this may not: stop before the suite (exit 1), printing the one command
#     to run, and the way to let those tests skip instead (make test TEST_REQUIRE=)
#
# Knobs (the tests of this script use them to stand in a fake apt): APT_GET (apt-get),
# REV88_CHROMIUM (as tests/test_web.py: a chromium binary; else `chromium` on PATH),
# PG_INITDB_GLOB (/usr/lib/postgresql/*/bin/initdb; else `initdb` on PATH, as tests/pg.py looks).
set -uo pipefail
REQUIRE=${REV88_TEST_REQUIRE-postgres,browser}
APT_GET=${APT_GET:-apt-get}
PG_INITDB_GLOB=${PG_INITDB_GLOB:-/usr/lib/postgresql/*/bin/initdb}

wants() { case ",$REQUIRE," in *",$1,"*|*",all,"*) return 0 ;; *) return 1 ;; esac; }

has_chromium() {
  { [ -n "${REV88_CHROMIUM:-}" ] && [ -x "$REV88_CHROMIUM" ]; } || command -v chromium >/dev/null 2>&1
}
has_postgres() {
  # shellcheck disable=SC2086 # the glob is meant to expand
  ls $PG_INITDB_GLOB >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1
}

missing=()
wants browser && ! has_chromium && missing+=(chromium)
wants postgres && ! has_postgres && missing+=(postgresql)
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

install="$APT_GET install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "make test: the tests need Debian's ${missing[*]} (REV88_TEST_REQUIRE=$REQUIRE), which are not installed," >&2
  echo "and this user may not install them (not root, and sudo asks for a password). Run:" >&2
  echo "    sudo $APT_GET update && sudo $install" >&2
  echo "then make test again; or let those tests skip: make test TEST_REQUIRE=" >&2
  exit 1
fi
echo "make test: installing Debian's ${missing[*]} (needed by REV88_TEST_REQUIRE=$REQUIRE)" >&2
if ! { "${sudo[@]}" "$APT_GET" update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" $install; }; then
  echo "make test: '${sudo[*]}${sudo:+ }$install' failed (see above); fix it and run make test again," >&2
  echo "or let those tests skip: make test TEST_REQUIRE=" >&2
  exit 1
fi
still=()
wants browser && ! has_chromium && still+=(chromium)
wants postgres && ! has_postgres && still+=(postgresql)
if [ "${#still[@]}" -ne 0 ]; then
  echo "make test: $APT_GET installed, but ${still[*]} still cannot be found (chromium on PATH, $PG_INITDB_GLOB)" >&2
  exit 1
fi
