#!/usr/bin/env bash
# Step 1 of the one-shot GPU acceptance (docs/gpu.md), here, before the device call: build what the
# call carries and check it the way the device will. The GPU machine has no network, so
# scripts/gpu_device_run.sh cannot fetch anything there: it refuses to start (exit status 6, before
# it touches the GPU) when something it carries is missing, and this script makes sure nothing is.
#
#     bash scripts/gpu_prepare.sh
#
#   1. .device-wheels/: kept when it already holds exactly the wheels of scripts/device_wheels.txt,
#      else built with scripts/make_device_wheels.sh (needs PyPI; REBUILD=1 always rebuilds)
#   2. scripts/gpu_carried.py --here: the wheels, data/mnist and the size of what travels (the
#      working tree git sends plus the wheels, at most 64 MiB) -- the device script runs the same
#      check, without the size, before anything else
#   3. prints the call to make
# Knobs: PYTHON (default .venv/bin/python, else python3), WHEELS (.device-wheels), SECTIONS
# (as for gpu_device_run.sh: without the service section no wheels are needed), REBUILD=1.
# Exit status 0 ready; 1 the wheels could not be built or something the call carries is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=${WHEELS:-.device-wheels}

if [ "${REBUILD:-0}" != 1 ] && "$PY" scripts/gpu_carried.py --wheels-only --wheels "$WHEELS"; then
  echo "gpu_prepare: $WHEELS already holds the wheels of scripts/device_wheels.txt (REBUILD=1 to build them again)"
else
  echo "gpu_prepare: building $WHEELS with scripts/make_device_wheels.sh"
  if ! PYTHON="$PY" bash scripts/make_device_wheels.sh "$WHEELS"; then
    echo "gpu_prepare: scripts/make_device_wheels.sh failed (it needs PyPI): the device call would refuse to start" >&2
    exit 1
  fi
fi

if ! "$PY" scripts/gpu_carried.py --here --wheels "$WHEELS" ${SECTIONS:+--sections "$SECTIONS"}; then
  echo "gpu_prepare: not ready: fix the problems above, then run this again" >&2
  exit 1
fi

prefix=
[ "$WHEELS" != .device-wheels ] && prefix="WHEELS=$WHEELS "
[ -n "${SECTIONS:-}" ] && prefix="${prefix}SECTIONS=$SECTIONS "
echo "gpu_prepare: ready. Rehearse it (docs/gpu.md), then make the call:"
echo "    run(command=\"${prefix}bash scripts/gpu_device_run.sh\", carry=[\"$WHEELS\"], timeout_s=480)"
