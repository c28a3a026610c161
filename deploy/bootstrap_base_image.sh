#!/usr/bin/env bash
# Offline stand-in for pulling the Dockerfile's base image (python:3.11-slim-bookworm).
#
# Where no container registry can be reached (the project's build VM reaches only PyPI and
# Debian's package mirrors), the base image is built from Debian packages instead: mmdebstrap
# bootstraps a minimal bookworm root with Python 3.11, pip, venv and the Python headers, and
# podman imports it under the Dockerfile's FROM name, so `podman build --pull=never` uses it.
# Differences from the official image: Python is Debian's 3.11 (/usr/bin/python3, with
# `python` and `pip` on PATH), not a source build under /usr/local; pip is Debian's.
# On a machine that can pull images, skip this script: `docker build .` pulls the real one.
#
#   deploy/bootstrap_base_image.sh            # needs root, podman and mmdebstrap
#
# Environment:
#   ENGINE        podman (default) or docker: the engine that imports the image
#   BASE_IMAGE    the name to tag (default: the Dockerfile's FROM)
#   DEBIAN_MIRROR default http://deb.debian.org/debian (the security suite comes from the
#                 matching debian-security path)
#   EXTRA_CA_DIR  folder of extra certificate authorities (*.crt) the image must trust, as the
#                 build machine does, so that pip inside `podman build` can reach the package
#                 index through a TLS-inspecting proxy (default /usr/local/share/ca-certificates)
#   FORCE=1       rebuild even if the image already exists
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-podman}
if [ "$ENGINE" = podman ] && [ -z "${CONTAINERS_CONF:-}" ]; then
  export CONTAINERS_CONF="$PWD/deploy/podman/containers.conf"
fi
BASE_IMAGE=${BASE_IMAGE:-$(awk 'toupper($1) == "FROM" { print $2; exit }' Dockerfile)}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
EXTRA_CA_DIR=${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}
SUITE=bookworm

# short names such as python:3.11-slim-bookworm live under docker.io/library/ in local storage
case "$BASE_IMAGE" in
  */*) FULL_NAME=$BASE_IMAGE ;;
  *) FULL_NAME=docker.io/library/$BASE_IMAGE ;;
esac

if [ -z "${FORCE:-}" ] && "$ENGINE" image exists "$FULL_NAME" 2>/dev/null; then
  echo "base image $FULL_NAME already present (FORCE=1 rebuilds it)"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "mmdebstrap not found (apt-get install mmdebstrap)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ca"
if [ -d "$EXTRA_CA_DIR" ]; then
  find "$EXTRA_CA_DIR" -maxdepth 1 -name '*.crt' -exec cp {} "$work/ca/" \;
fi
echo "bootstrapping $SUITE (minbase + python3) with $(find "$work/ca" -name '*.crt' | wc -l) extra CA(s)"

start=$(date +%s)
mmdebstrap --variant=minbase --mode=root \
  --include=python3,python3-pip,python3-venv,python3-dev,python-is-python3,ca-certificates \
  --customize-hook="mkdir -p \"\$1/usr/local/share/ca-certificates\" && cp -r \"$work/ca/.\" \"\$1/usr/local/share/ca-certificates/\"" \
  --customize-hook='chroot "$1" update-ca-certificates --fresh >/dev/null' \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  "$SUITE" "$work/rootfs.tar" \
  "deb $DEBIAN_MIRROR $SUITE main" \
  "deb $DEBIAN_MIRROR $SUITE-updates main" \
  "deb ${DEBIAN_MIRROR%/debian}/debian-security $SUITE-security main"

"$ENGINE" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --change 'LABEL org.opencontainers.image.description="Offline stand-in for python:3.11-slim-bookworm, bootstrapped from Debian packages by deploy/bootstrap_base_image.sh"' \
  "$work/rootfs.tar" "$FULL_NAME" >/dev/null
echo "imported $FULL_NAME in $(( $(date +%s) - start )) s"
"$ENGINE" run --rm --pull=never "$FULL_NAME" python -c "import sys, ssl; print('python', sys.version.split()[0], ssl.OPENSSL_VERSION)"
