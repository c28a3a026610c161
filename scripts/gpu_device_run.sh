#!/usr/bin/env bash
# A GPU check on a lent device: one `run` call of at most 10 minutes (docs/gpu.md). The plan, two calls
# (their budgets, timeouts and projected device seconds: scripts/gpu_budget.py, which a test replays):
#
#   run(command="SECTIONS=precheck,cuda,energy,fused,service BUDGET_S=330 DEVICE_TIMEOUT_S=405 bash scripts/gpu_device_run.sh",
#       carry=[".device-wheels", ".device-reference"], timeout_s=405)      # 1: the one-shot without its tests
#   run(command="SECTIONS=precheck,tune,tests BUDGET_S=255 DEVICE_TIMEOUT_S=330 bash scripts/gpu_device_run.sh",
#       carry=[".device-wheels", ".device-reference"], timeout_s=330)      # 2: the tuning run and the GPU tests
#
# With the defaults (BUDGET_S 400, DEVICE_TIMEOUT_S 480) it runs the whole one-shot (every section
# but tune) in one call. Here, once, before the calls (needs PyPI; the device has no network):
#     bash scripts/gpu_prepare.sh     # .device-wheels/ (15 wheels) and .device-reference/ (the cpu reference)
#     python3 scripts/gpu_check.py --dry-run --out /tmp/gpu-dry   # every section rehearsed
# Carry both folders: the repository (data/mnist included, ~14 MB) travels by itself. Without what
# it carries this script refuses to start (exit status 6) before it touches the GPU.
#
# Knobs (environment): BUDGET_S (400: gpu_check.py --budget-s, a hard limit), DEVICE_TIMEOUT_S
# (480: the call's timeout_s; the budget is lowered so that everything fits inside it),
# INNER_TIMEOUT_S (BUDGET_S + 40: the backstop `timeout`; set it lower only to rehearse a
# timeout), SECTIONS, DRY_RUN=1, PYTHON (python3), OUT, WORK (the run's folder, outside $OUT),
# WHEELS (.device-wheels), REFERENCE (.device-reference/cpu_reference.npz), DEVICE_BUDGET_S (a dry
# run: the device budget its decisions are made for, default BUDGET_S).
# Rehearse it here, without a GPU:
#     DRY_RUN=1 PYTHON=.venv/bin/python OUT=/tmp/o bash scripts/gpu_device_run.sh
# (gpu_check.py --dry-run --device-budget-s $DEVICE_BUDGET_S: its budget decisions on the device clock
# that scripts/gpu_budget.py projects; the cp312 wheels do not install on another Python, which it reports).
#
# What it does:
#   0. scripts/gpu_carried.py: the wheels of scripts/device_wheels.txt (when the service section
#      runs), the cpu reference (when cuda, fused or tune runs) and the four MNIST files are
#      there; if not, it names what is missing and exits 6
#   1. installs the carried wheels into /tmp/rev88-site and puts it and the checkout on PYTHONPATH,
#      then says which of the service's packages are still missing (wheels that do not install,
#      e.g. on another Python: the service section then fails at once; the others run: the learner
#      needs none of the wheels)
#   2. makes /tmp/rev88-libcuda with libcuda.so.1 and an unversioned libcuda.so pointing at the
#      driver's 64-bit libcuda.so.1 (scripts/gpu_find_libcuda.sh), exports TRITON_LIBCUDA_PATH
#   3. if the running Python's Python.h is not where sysconfig says, looks for it and exports
#      C_INCLUDE_PATH (Triton compiles its launcher with it)
#   4. runs scripts/gpu_check.py --out $WORK --publish $OUT --budget-s 400 under `timeout -k 10 440`
#      (BUDGET_S, INNER_TIMEOUT_S; both lowered if the setup left too little of DEVICE_TIMEOUT_S)
#   5. $OUT holds at most 5 files at any moment: gpu_check.json, summary.txt, run.log,
#      gpu-check-bundle.tar.gz (every section's own file, the tuning run's folder, the server's
#      log; not the service's ledger), each replaced after every section (and every tuning
#      candidate), and a file being replaced; the summary is printed last.
# Exit status: 0 passed, 1 a section failed, 2 bad input / no GPU, 3 the time budget ran out
# (a section interrupted, cut or not started; the inner timeout's 124 lands here when gpu_check.py
# wrote its final report), 4 gpu_check.py was killed (the timeout's SIGKILL, 137, or another
# signal): the files are those of the last finished section, 5 no final report (gpu_check.py did
# not start or crashed: see run.log), 6 refused to start: something the call carries is missing
# (summary.txt and run.log name it; nothing ran on the GPU).
set -uo pipefail
T0=$SECONDS
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/rev88-gpu-out}
WORK=${WORK:-/tmp/rev88-gpu-check}
WHEELS=${WHEELS:-.device-wheels}
REFERENCE=${REFERENCE:-.device-reference/cpu_reference.npz}
BUDGET_S=${BUDGET_S:-400}
DEVICE_TIMEOUT_S=${DEVICE_TIMEOUT_S:-480}
KILL_AFTER_S=10   # SIGTERM -> SIGKILL; the service's child server gets 5 of these (INTERRUPT_GRACE_S)
TAIL_S=15         # after gpu_check.py: the last tar and the summary
GRACE_S=40        # budget -> backstop: a section stuck in a long C call still gets its SIGTERM
case "$(realpath -m "$WORK")/" in "$(realpath -m "$OUT")"/*)
  echo "WORK=$WORK lies inside OUT=$OUT: its files would count among the 8 that come back" >&2; exit 5 ;;
esac
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rev88-triton-cache
export REV88_CPU_REFERENCE="$(realpath -m "$REFERENCE")"  # scripts/gpu_reference.py reads it
LOG=$OUT/run.log
: >"$LOG"
say() { echo "[device] $*" | tee -a "$LOG"; }

say "$(date -u +%FT%TZ) on $(hostname): $($PY -V 2>&1) at $(command -v $PY)"

# 0. what the call carries, before anything touches the GPU: the wheels (when the service section
# runs) and data/mnist. Without them: refuse to start (scripts/gpu_prepare.sh makes them, here)
carried=$($PY scripts/gpu_carried.py --wheels "$WHEELS" --reference "$REFERENCE" ${SECTIONS:+--sections "$SECTIONS"} 2>&1)
carried_rc=$?
echo "$carried" | tee -a "$LOG"
if [ "$carried_rc" -ne 0 ]; then
  refusal="gpu_device_run.sh: exit status 6 (refused to start: something the call carries is missing, see above;
nothing ran on the GPU. Run \`bash scripts/gpu_prepare.sh\` here, then call again with carry=[\"$WHEELS\", \"$(dirname "$REFERENCE")\"])"
  say "$refusal"
  printf '%s\n%s\n' "$carried" "$refusal" >"$OUT/.summary.txt.part" && mv -f "$OUT/.summary.txt.part" "$OUT/summary.txt"
  exit 6
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.draw --format=csv,noheader || echo "nvidia-smi failed"; } 2>&1 | tee -a "$LOG"

# 1. the service's wheels
SITE=/tmp/rev88-site
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl >>"$LOG" 2>&1; then
    say "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
  else
    say "WARNING: installing the wheels from $WHEELS failed (pip's output is in run.log)"
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  say "no $WHEELS/*.whl carried: not needed without the service section (scripts/gpu_prepare.sh makes them)"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
# what the sections will find: said as a fact, not guessed
missing=$($PY - <<'EOF' 2>>"$LOG"
import importlib.util, sys
sys.path.insert(0, "scripts")
import gpu_check_common as c
print(" ".join(d for d, m in c.SERVICE_MODULES.items() if importlib.util.find_spec(m) is None))
EOF
) || missing="(could not be checked: see run.log)"
if [ -n "$missing" ]; then
  say "WARNING: the service's packages $missing are missing: the service section will fail at once (the others run)"
fi

# 2. libcuda for Triton's launcher
if real=$(bash scripts/gpu_find_libcuda.sh 2>>"$LOG"); then
  mkdir -p /tmp/rev88-libcuda
  ln -sf "$real" /tmp/rev88-libcuda/libcuda.so.1
  ln -sf "$real" /tmp/rev88-libcuda/libcuda.so
  export TRITON_LIBCUDA_PATH=/tmp/rev88-libcuda
  say "TRITON_LIBCUDA_PATH=/tmp/rev88-libcuda -> $real"
else
  say "WARNING: no 64-bit libcuda.so.1 found (ldconfig -p, LD_LIBRARY_PATH, the usual folders; see run.log); the pre-check will say more"
fi

# 3. Python.h where Triton's compiler will look
inc=$($PY -c 'import sysconfig as s; k=s.get_default_scheme(); k="posix_prefix" if k=="posix_local" else k; print(s.get_paths(scheme=k)["include"])')
ver=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ ! -f "$inc/Python.h" ]; then
  found=$(timeout 20 find /usr/include /usr/local/include /opt /root -maxdepth 6 -path "*python$ver*/Python.h" 2>/dev/null | head -1)
  if [ -n "$found" ]; then
    export C_INCLUDE_PATH="$(dirname "$found")${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
    say "Python.h not in $inc; using $found (C_INCLUDE_PATH)"
  else
    say "WARNING: no Python.h for Python $ver ($inc); the pre-check will stop the run"
  fi
fi

# 3b. the learner's C helpers, built in place as `pip install` builds them here (each optional:
# without it the learner does the same work the plain way, the same bytes)
suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
build_ext() {  # build_ext NAME SOURCE FLAGS...: learner/NAME$suffix from SOURCE, 0 if built
  local name=$1 source=$2
  shift 2
  ${CC:-gcc} "$@" -fPIC -shared -I"$inc" ${C_INCLUDE_PATH:+-I"${C_INCLUDE_PATH%%:*}"} \
    "$source" -o "learner/$name$suffix" >>"$LOG" 2>&1
}
# the SHA-256 lanes (learner/sha256_lanes.c: a launch's hashes sixteen side by side where the CPU
# has AVX-512); without them the service hashes with hashlib (more host CPU a cell)
if build_ext _sha256_lanes learner/sha256_lanes.c -O3 -fno-strict-aliasing; then
  say "built learner/_sha256_lanes$suffix: $($PY -c 'from learner.hashing import lanes_speedup as s; print(f"lanes at {s():.2f} x hashlib here")' 2>>"$LOG")"
else
  say "WARNING: could not build the SHA-256 lanes (see run.log): the service hashes with hashlib"
fi
# the permutations (learner/permutations.c: a batch of seeds' epoch permutations in one call, checked
# against numpy before use); without them numpy draws them one seed at a time
if build_ext _permutations learner/permutations.c -O2; then
  say "built learner/_permutations$suffix: $($PY -c 'from learner.permutations import fast; print("the same as numpy here: used" if fast() else "NOT the same as numpy here: numpy draws them")' 2>>"$LOG")"
else
  say "WARNING: could not build the permutations (see run.log): numpy draws them one seed at a time"
fi

# 4. the check, inside the call's timeout: setup so far + inner timeout + kill + tail <= DEVICE_TIMEOUT_S
inner=${INNER_TIMEOUT_S:-$((BUDGET_S + GRACE_S))}
room=$((DEVICE_TIMEOUT_S - (SECONDS - T0) - KILL_AFTER_S - TAIL_S))
if [ "$inner" -gt "$room" ]; then
  inner=$room
  if [ $((inner - GRACE_S)) -lt "$BUDGET_S" ]; then BUDGET_S=$((inner - GRACE_S)); fi
  say "only $room s of the call's $DEVICE_TIMEOUT_S s are left for the check: budget $BUDGET_S s, timeout $inner s"
fi
if [ "$BUDGET_S" -lt 1 ] || [ "$inner" -lt 1 ]; then
  say "no time left for the check (budget $BUDGET_S s, timeout $inner s of DEVICE_TIMEOUT_S=$DEVICE_TIMEOUT_S)"
  echo "not run: no time left in DEVICE_TIMEOUT_S=$DEVICE_TIMEOUT_S (exit status 5)" >"$OUT/summary.txt"
  exit 5
fi
DEVICE_BUDGET_S=${DEVICE_BUDGET_S:-$BUDGET_S}  # a dry run: the device budget its decisions are made for
say "running scripts/gpu_check.py ${DRY_RUN:+--dry-run --device-budget-s $DEVICE_BUDGET_S }--budget-s $BUDGET_S ${SECTIONS:+--sections $SECTIONS }under timeout -k $KILL_AFTER_S $inner"
timeout -k "$KILL_AFTER_S" "$inner" $PY scripts/gpu_check.py --out "$WORK" --publish "$OUT" --budget-s "$BUDGET_S" \
  ${DRY_RUN:+--dry-run --device-budget-s "$DEVICE_BUDGET_S"} ${SECTIONS:+--sections "$SECTIONS"} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
final=$($PY -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["exit_status"] if r.get("finished") else "")' \
  "$WORK/gpu_check.json" 2>/dev/null)
case "$rc" in
  0|1|2|3) if [ "$final" = "$rc" ]; then status=$rc; else status=5; fi ;;
  124) if [ -n "$final" ]; then status=$final; else status=4; fi ;;  # SIGTERM from timeout, report written
  *) if [ "$rc" -gt 128 ]; then status=4; else status=5; fi ;;          # 137: SIGKILL; else a crash
esac
meaning=(passed "a section failed" "bad input or no GPU" "the time budget ran out: partial figures"
         "gpu_check.py was killed: the files are those of its last finished section"
         "no final report: gpu_check.py did not start or crashed (see run.log)")
say "gpu_check.py exit status $rc (timeout: 124 = SIGTERM sent, 137 = SIGKILL); this script's exit status $status: ${meaning[$status]}"

# 5. what comes back: gpu_check.json, summary.txt, run.log, gpu-check-bundle.tar.gz
[ -f "$WORK/gpu_check.json" ] && [ ! -f "$OUT/gpu_check.json" ] && cp "$WORK/gpu_check.json" "$OUT/"
if [ "$status" -ge 4 ] || [ ! -f "$WORK/summary.txt" ]; then
  { cat "$WORK/summary.txt" 2>/dev/null || echo "no summary from gpu_check.py"; } >"$WORK/summary.txt.new"
  mv -f "$WORK/summary.txt.new" "$WORK/summary.txt"
fi
echo "gpu_device_run.sh: exit status $status (${meaning[$status]}; gpu_check.py $rc)" >>"$WORK/summary.txt"
cp "$WORK/summary.txt" "$OUT/.summary.txt.part" && mv -f "$OUT/.summary.txt.part" "$OUT/summary.txt"
cp "$LOG" "$WORK/run.log"
tar -czf "$OUT/.gpu-check-bundle.tar.gz.part" -C "$(dirname "$WORK")" --transform "s|^$(basename "$WORK")|check|" \
  --exclude=service-data --exclude='*.part' "$(basename "$WORK")" \
  && mv -f "$OUT/.gpu-check-bundle.tar.gz.part" "$OUT/gpu-check-bundle.tar.gz"
ls -l "$OUT"
echo
cat "$OUT/summary.txt"
exit "$status"
