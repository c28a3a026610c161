#!/usr/bin/env bash
# Step 1 of a GPU run (docs/gpu.md), here, before the device calls: build what the calls carry and
# check it the way the device will. The GPU machine has no network, so scripts/gpu_device_run.sh
# cannot fetch anything there: it refuses to start (exit status 6, before it touches the GPU) when
# something it carries is missing, and this script makes sure nothing is.
#
#     bash scripts/gpu_prepare.sh
#
#   1. .device-wheels/: kept when it already holds exactly the wheels of scripts/device_wheels.txt,
#      else built with scripts/make_device_wheels.sh (needs PyPI; REBUILD=1 always rebuilds)
#   2. .device-reference/cpu_reference.npz: the cpu backend's predictions on the eleven draws and
#      on the 131 other tasks of a 132-task launch (scripts/gpu_reference.py, ~30 s here), kept
#      when it is already the reference of the draws built here (REBUILD=1 always rebuilds)
#   3. scripts/gpu_carried.py --here: the wheels, the reference, data/mnist and the size of what
#      travels (the working tree git sends plus the carried folders, at most 64 MiB) -- the device
#      script runs the same check, without the size, before anything else
#   4. prints the calls to make (scripts/gpu_budget.py's plan)
# Knobs: PYTHON (default .venv/bin/python, else python3), WHEELS (.device-wheels), REFERENCE
# (.device-reference/cpu_reference.npz), SECTIONS (as for gpu_device_run.sh: without the service
# section no wheels are needed, without cuda, fused and tune no reference), REBUILD=1.
# Exit status 0 ready; 1 something could not be built or something the call carries is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=${WHEELS:-.device-wheels}
REFERENCE=${REFERENCE:-.device-reference/cpu_reference.npz}

if [ "${REBUILD:-0}" != 1 ] && "$PY" scripts/gpu_carried.py --wheels-only --wheels "$WHEELS"; then
  echo "gpu_prepare: $WHEELS already holds the wheels of scripts/device_wheels.txt (REBUILD=1 to build them again)"
else
  echo "gpu_prepare: building $WHEELS with scripts/make_device_wheels.sh"
  if ! PYTHON="$PY" bash scripts/make_device_wheels.sh "$WHEELS"; then
    echo "gpu_prepare: scripts/make_device_wheels.sh failed (it needs PyPI): the device call would refuse to start" >&2
    exit 1
  fi
fi

needs_reference=1
case ",${SECTIONS:-cuda}," in *,cuda,*|*,fused,*|*,tune,*) ;; *) needs_reference=0 ;; esac
if [ "$needs_reference" = 0 ]; then
  echo "gpu_prepare: no cpu reference needed (no cuda, fused or tune section in $SECTIONS)"
elif [ "${REBUILD:-0}" != 1 ] && "$PY" scripts/gpu_reference.py --check --out "$REFERENCE"; then
  echo "gpu_prepare: $REFERENCE is already the cpu reference of the draws built here (REBUILD=1 to compute it again)"
else
  echo "gpu_prepare: computing $REFERENCE with scripts/gpu_reference.py (the cpu backend, ~30 s)"
  if ! "$PY" scripts/gpu_reference.py --quiet --out "$REFERENCE"; then
    echo "gpu_prepare: scripts/gpu_reference.py failed: the device call would refuse to start" >&2
    exit 1
  fi
fi

if ! "$PY" scripts/gpu_carried.py --here --wheels "$WHEELS" --reference "$REFERENCE" ${SECTIONS:+--sections "$SECTIONS"}; then
  echo "gpu_prepare: not ready: fix the problems above, then run this again" >&2
  exit 1
fi

echo "gpu_prepare: ready. Rehearse it (docs/gpu.md), then make the calls:"
WHEELS="$WHEELS" REFERENCE="$REFERENCE" "$PY" scripts/gpu_budget.py --calls
