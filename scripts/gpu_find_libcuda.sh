#!/usr/bin/env bash
# Print the driver's 64-bit libcuda.so.1 (resolved), for Triton's launcher; exit 1, saying why on
# stderr, if there is none. Used by scripts/gpu_device_run.sh.
#
# In this order, the first that is a 64-bit ELF of this machine's architecture:
#   1. `ldconfig -p` lines "libcuda.so.1 (libc6,x86-64) => PATH" whose arch field names this
#      machine's (x86-64 here; a 32-bit "(libc6)" entry is skipped)
#   2. each folder of LD_LIBRARY_PATH, then the usual driver folders ($LIBCUDA_DIRS)
#   3. /usr/local/cuda/compat ($COMPAT_DIR) only when its libcuda.so.<version> is the running
#      driver's version (the forward-compatibility library of another driver fails at cuInit)
# Overridable for rehearsals: LDCONFIG, LIBCUDA_DIRS, COMPAT_DIR, DRIVER_VERSION (else read from
# nvidia-smi or /proc/driver/nvidia/version).
set -uo pipefail
LDCONFIG=${LDCONFIG:-/sbin/ldconfig}
LIBCUDA_DIRS=${LIBCUDA_DIRS:-/usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib}
COMPAT_DIR=${COMPAT_DIR:-/usr/local/cuda/compat}

case "$(uname -m)" in
  x86_64|amd64) ld_arch=x86-64; elf_machine=3e00 ;;
  aarch64|arm64) ld_arch=AArch64; elf_machine=b700 ;;
  *) echo "gpu_find_libcuda: unsupported machine $(uname -m)" >&2; exit 1 ;;
esac

# 64-bit (EI_CLASS 2), little-endian ELF whose e_machine is this machine's
is_native_elf64() {
  local f=$1
  [ -f "$f" ] || return 1
  [ "$(od -An -tx1 -N4 "$f" 2>/dev/null | tr -d ' \n')" = 7f454c46 ] || return 1
  [ "$(od -An -tx1 -j4 -N2 "$f" 2>/dev/null | tr -d ' \n')" = 0201 ] || return 1
  [ "$(od -An -tx1 -j18 -N2 "$f" 2>/dev/null | tr -d ' \n')" = "$elf_machine" ]
}

pick() {  # first native candidate, resolved
  local cand real
  for cand in "$@"; do
    real=$(readlink -f "$cand" 2>/dev/null) || continue
    if is_native_elf64 "$real"; then echo "$real"; return 0; fi
    [ -e "$cand" ] && echo "gpu_find_libcuda: skipped $cand -> $real (not a 64-bit $ld_arch ELF)" >&2
  done
  return 1
}

# 1. ldconfig's cache, by the arch field
from_ldconfig=$("$LDCONFIG" -p 2>/dev/null | awk -v arch="$ld_arch" \
  '$1 == "libcuda.so.1" && index($2, arch) && $(NF-1) == "=>" {print $NF}')
# shellcheck disable=SC2086
pick $from_ldconfig && exit 0

# 2. LD_LIBRARY_PATH, the usual folders
dirs=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' ')
cands=()
for d in $dirs $LIBCUDA_DIRS; do cands+=("$d/libcuda.so.1"); done
pick "${cands[@]}" && exit 0

# 3. the compat folder, only for the running driver
driver=${DRIVER_VERSION:-}
if [ -z "$driver" ]; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
fi
if [ -z "$driver" ] && [ -r /proc/driver/nvidia/version ]; then
  driver=$(sed -n 's/.*Kernel Module[^0-9]*\([0-9][0-9.]*\).*/\1/p' /proc/driver/nvidia/version | head -1)
fi
if [ -e "$COMPAT_DIR/libcuda.so.1" ]; then
  compat=$(readlink -f "$COMPAT_DIR/libcuda.so.1")
  compat_version=${compat##*/libcuda.so.}
  if [ -n "$driver" ] && [ "$compat_version" = "$driver" ]; then
    pick "$COMPAT_DIR/libcuda.so.1" && exit 0
  fi
  echo "gpu_find_libcuda: not using $compat (version $compat_version; the running driver is ${driver:-unknown})" >&2
fi
echo "gpu_find_libcuda: no 64-bit $ld_arch libcuda.so.1 in ldconfig -p, LD_LIBRARY_PATH or $LIBCUDA_DIRS" >&2
exit 1
