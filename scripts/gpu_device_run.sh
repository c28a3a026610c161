#!/usr/bin/env bash
# The one-shot GPU acceptance on a lent device: one `run` call, about 8 minutes.
#
# Here, once, before the call (needs PyPI; the device has no network):
#     bash scripts/make_device_wheels.sh          # -> .device-wheels/ (ignored by git, ~3 MiB)
#     .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-dry   # every section rehearsed
# Then the call (command, carry, timeout):
#     run(command="bash scripts/gpu_device_run.sh", carry=[".device-wheels"], timeout_s=590)
# Carry only .device-wheels: the repository (data/mnist included, ~12 MB) travels by itself,
# and the wheels add ~3 MiB of the 64 MiB limit. Rerun a part on the still-warm machine with
# `SECTIONS=fused,service bash scripts/gpu_device_run.sh` (the pre-check always runs first).
# Rehearse this script here, without a GPU: `DRY_RUN=1 PYTHON=.venv/bin/python OUT=/tmp/o bash
# scripts/gpu_device_run.sh` (gpu_check.py --dry-run; the cp312 wheels then do not install on
# another Python, which it reports and goes on).
#
# What it does, everything under $OUT (at most 8 files come back, so the rest is bundled):
#   1. installs the carried wheels into /tmp/rev88-site and puts it and the checkout on PYTHONPATH
#   2. makes /tmp/rev88-libcuda with libcuda.so.1 and an unversioned libcuda.so pointing at the
#      driver's libcuda.so.1, and exports TRITON_LIBCUDA_PATH (older Tritons link -lcuda)
#   3. if the running Python's Python.h is not where sysconfig says, looks for it and exports
#      C_INCLUDE_PATH (Triton compiles its launcher with it)
#   4. runs scripts/gpu_check.py (the pre-check first; it stops the run early if the toolchain is
#      broken) under `timeout`, with a 470 s budget
#   5. writes $OUT/gpu_check.json, $OUT/summary.txt, $OUT/run.log and $OUT/gpu-check-bundle.tar.gz
#      (every section's files), and prints the summary last.
# Exit status: gpu_check.py's (0 passed, 1 a section failed, 2 bad input / no GPU; 124 timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/rev88-gpu-out}
WORK=$OUT/check
mkdir -p "$WORK"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rev88-triton-cache
LOG=$WORK/run.log
say() { echo "[device] $*" | tee -a "$LOG"; }

say "$(date -u +%FT%TZ) on $(hostname): $($PY -V 2>&1) at $(command -v $PY)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.draw --format=csv,noheader || echo "nvidia-smi failed"; } 2>&1 | tee -a "$LOG"

# 1. the service's wheels
SITE=/tmp/rev88-site
if compgen -G ".device-wheels/*.whl" >/dev/null; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .device-wheels/*.whl >>"$LOG" 2>&1; then
    say "installed $(ls .device-wheels/*.whl | wc -l) wheels into $SITE"
  else
    say "WARNING: installing the wheels failed (see run.log); the service section will fail"
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  say "WARNING: no .device-wheels/*.whl (carry .device-wheels; make it with scripts/make_device_wheels.sh)"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# 2. libcuda for Triton's launcher
real=""
for cand in $(/sbin/ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}') \
    $(echo "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | sed -n 's|$|/libcuda.so.1|p') \
    /usr/local/nvidia/lib64/libcuda.so.1 /usr/local/nvidia/lib/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 \
    /usr/lib64/libcuda.so.1 /usr/local/cuda/compat/libcuda.so.1; do
  if [ -e "$cand" ]; then real=$(readlink -f "$cand"); break; fi
done
if [ -n "$real" ]; then
  mkdir -p /tmp/rev88-libcuda
  ln -sf "$real" /tmp/rev88-libcuda/libcuda.so.1
  ln -sf "$real" /tmp/rev88-libcuda/libcuda.so
  export TRITON_LIBCUDA_PATH=/tmp/rev88-libcuda
  say "TRITON_LIBCUDA_PATH=/tmp/rev88-libcuda -> $real"
else
  say "WARNING: no libcuda.so.1 found (ldconfig -p, LD_LIBRARY_PATH, the usual folders); the pre-check will say more"
fi

# 3. Python.h where Triton's compiler will look
inc=$($PY -c 'import sysconfig as s; k=s.get_default_scheme(); k="posix_prefix" if k=="posix_local" else k; print(s.get_paths(scheme=k)["include"])')
ver=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ ! -f "$inc/Python.h" ]; then
  found=$(find /usr/include /usr/local/include /opt /root -maxdepth 6 -path "*python$ver*/Python.h" 2>/dev/null | head -1)
  if [ -n "$found" ]; then
    export C_INCLUDE_PATH="$(dirname "$found")${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
    say "Python.h not in $inc; using $found (C_INCLUDE_PATH)"
  else
    say "WARNING: no Python.h for Python $ver ($inc); the pre-check will stop the run"
  fi
fi

# 4. the check
say "running scripts/gpu_check.py ${DRY_RUN:+--dry-run }${SECTIONS:+--sections $SECTIONS}"
timeout -k 15 540 $PY scripts/gpu_check.py --out "$WORK" --budget-s 470 ${DRY_RUN:+--dry-run} \
  ${SECTIONS:+--sections "$SECTIONS"} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "gpu_check.py exit status $rc"

# 5. what comes back: four files
cp "$WORK/gpu_check.json" "$OUT/" 2>/dev/null
cp "$WORK/summary.txt" "$OUT/" 2>/dev/null || echo "no summary (exit status $rc): see run.log" >"$OUT/summary.txt"
cp "$LOG" "$OUT/run.log"
tar -czf "$OUT/gpu-check-bundle.tar.gz" -C "$OUT" check && rm -rf "$WORK"
ls -l "$OUT"
echo
cat "$OUT/summary.txt"
exit "$rc"
