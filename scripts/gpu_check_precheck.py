"""The toolchain pre-check: runs first in scripts/gpu_check.py and stops the run early (with this
report) when the machine cannot build and launch a Triton kernel.

Triton builds a small C launcher the first time a kernel runs: it needs a C compiler (``CC``, else
``gcc``, else ``clang``), ``Python.h`` of the running Python (sysconfig's include folder, or a
folder on ``C_INCLUDE_PATH``), and, to link against the driver, ``libcuda.so.1`` found through
``TRITON_LIBCUDA_PATH`` or ``/sbin/ldconfig -p`` (newer Tritons link ``-l:libcuda.so.1``; older
ones link ``-lcuda``, which needs an unversioned ``libcuda.so`` in that folder:
scripts/gpu_device_run.sh makes one). Checks:

  versions            python, torch, triton, numpy, the service's packages (what ran, not the pins)
  cuda                torch sees a CUDA GPU                                (device only)
  python_h            Python.h where the compiler will look
  c_compiler          the compiler Triton will pick, and its version line
  python_extension    that compiler builds a shared object including Python.h
  libcuda             libcuda.so.1 where Triton looks, 64-bit, and a link with
                      -l:libcuda.so.1 or -lcuda (only -l:libcuda.so.1: passed, with a
                      warning that a -lcuda Triton would need libcuda.so)  (device only)
  triton_kernel       a 16-element Triton kernel launched and its result checked (in the
                      dry run: in Triton's interpreter, on the CPU)
  service_packages    fastapi, starlette, pydantic, uvicorn, python-multipart, ... importable
                      and their requirements met (not blocking: only the service section needs them)

``passed`` is the blocking checks only. Alone: ``python3 scripts/gpu_check_precheck.py [--dry-run]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as common  # noqa: E402

BLOCKING = ("cuda", "python_h", "c_compiler", "python_extension", "libcuda", "triton_kernel")


def _tail(text: str, n: int = 1500) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def python_include_dir() -> str:
    """The folder Triton passes as -I for Python.h (its own scheme logic)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def check_python_h() -> dict:
    include = python_include_dir()
    candidates = [include] + [d for d in os.environ.get("C_INCLUDE_PATH", "").split(":") if d]
    found = next((d for d in candidates if (Path(d) / "Python.h").is_file()), None)
    out = {"sysconfig_include": include, "c_include_path": os.environ.get("C_INCLUDE_PATH"), "found_in": found,
           "passed": found is not None}
    if found is None:
        out["error"] = (f"Python.h of Python {sys.version.split()[0]} is not in {include} nor on C_INCLUDE_PATH: "
                        "Triton cannot build its launcher (install the python3-dev headers, or carry them "
                        "and point C_INCLUDE_PATH at them)")
    return out


def find_compiler() -> str | None:
    """Triton's choice: $CC, else gcc, else clang."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def check_compiler() -> dict:
    cc = find_compiler()
    if cc is None:
        return {"passed": False, "error": "no C compiler: set CC, or install gcc or clang (Triton builds a launcher)"}
    try:
        line = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except Exception as exc:  # noqa: BLE001
        return {"compiler": cc, "passed": False, "error": f"{cc} --version failed: {exc}"}
    return {"compiler": cc, "version": line, "passed": True}


def _cc(cc: str, args: list[str], workdir: Path) -> tuple[bool, str]:
    proc = subprocess.run([cc, *args], capture_output=True, text=True, timeout=120, cwd=workdir)
    return proc.returncode == 0, _tail(proc.stderr + proc.stdout)


EXTENSION_C = """#include <Python.h>
static PyObject *ping(PyObject *self, PyObject *args) { return PyLong_FromLong(16); }
static PyMethodDef methods[] = {{"ping", ping, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "rev88_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_rev88_probe(void) { return PyModule_Create(&mod); }
"""


def check_python_extension(workdir: Path) -> dict:
    cc = find_compiler()
    if cc is None:
        return {"passed": False, "error": "no C compiler"}
    src = workdir / "rev88_probe.c"
    src.write_text(EXTENSION_C)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    so = workdir / f"rev88_probe{suffix}"
    ok, log = _cc(cc, [str(src), "-O1", "-shared", "-fPIC", "-o", str(so), f"-I{python_include_dir()}"], workdir)
    out = {"passed": False, "command": f"{cc} rev88_probe.c -shared -fPIC -I{python_include_dir()}"}
    if not ok:
        return {**out, "error": "building a Python extension failed (what Triton does at its first launch)",
                "compiler_output": log}
    spec = importlib.util.spec_from_file_location("rev88_probe", so)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        out["passed"] = module.ping() == 16
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"the built extension does not load: {exc}"
    return out


def libcuda_dirs() -> tuple[list[str], str]:
    """Where Triton will look for libcuda.so.1, and how it found them (its own order)."""
    env = os.environ.get("TRITON_LIBCUDA_PATH")
    if env:
        return [env], "TRITON_LIBCUDA_PATH"
    try:
        libs = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except Exception:  # noqa: BLE001
        libs = ""
    dirs = [os.path.dirname(line.split()[-1]) for line in libs.splitlines() if "libcuda.so.1" in line]
    if dirs:
        return dirs, "ldconfig -p"
    ld = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and os.path.exists(os.path.join(d, "libcuda.so.1"))]
    return ld, "LD_LIBRARY_PATH"


# How Tritons link their launcher against the driver: newer ones by the soname, older ones by -lcuda.
LINK_FLAGS = ("-l:libcuda.so.1", "-lcuda")

# ELF e_machine of the architectures this can run on (the device is x86-64).
ELF_MACHINES = {62: "x86-64", 183: "aarch64", 3: "i386", 40: "arm"}
RUNNING_MACHINE = {"x86_64": "x86-64", "amd64": "x86-64", "aarch64": "aarch64", "arm64": "aarch64"}


def elf_arch(path: str) -> str:
    """'64-bit x86-64' and the like from a shared object's ELF header (what a 32-bit libcuda
    in ldconfig's cache would betray), or why it could not be read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(20)
    except OSError as exc:
        return f"unreadable: {exc}"
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return "not an ELF file"
    bits = {1: "32-bit", 2: "64-bit"}.get(head[4], f"class {head[4]}")
    machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return f"{bits} {ELF_MACHINES.get(machine, f'machine {machine}')}"


def check_libcuda(workdir: Path) -> dict:
    out: dict = {"TRITON_LIBCUDA_PATH": os.environ.get("TRITON_LIBCUDA_PATH")}
    try:
        proc = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=30)
        out["ldconfig_runs"] = proc.returncode == 0
        out["ldconfig_libcuda_lines"] = [line.strip() for line in proc.stdout.splitlines() if "libcuda.so" in line]
    except Exception as exc:  # noqa: BLE001
        out["ldconfig_runs"] = False
        out["ldconfig_error"] = f"{type(exc).__name__}: {exc}"
    dirs, how = libcuda_dirs()
    out.update({"dirs": dirs, "found_by": how})
    with_so1 = [d for d in dirs if os.path.exists(os.path.join(d, "libcuda.so.1"))]
    with_so = [d for d in dirs if os.path.exists(os.path.join(d, "libcuda.so"))]
    out.update({"dirs_with_libcuda_so_1": with_so1, "dirs_with_unversioned_libcuda_so": with_so})
    if not with_so1:
        return {**out, "passed": False, "error": f"no libcuda.so.1 where Triton looks ({how}: {dirs}); set "
                "TRITON_LIBCUDA_PATH to a folder holding libcuda.so.1 and a libcuda.so symlink to it"}
    first = os.path.realpath(os.path.join(with_so1[0], "libcuda.so.1"))
    want = "64-bit " + RUNNING_MACHINE.get(platform.machine().lower(), platform.machine())
    out.update({"libcuda_so_1": first, "libcuda_so_1_arch": elf_arch(first), "machine_arch": want})
    if out["libcuda_so_1_arch"] != want:
        return {**out, "passed": False, "error": f"the libcuda.so.1 Triton finds first ({first}) is "
                f"{out['libcuda_so_1_arch']}, not {want}: point TRITON_LIBCUDA_PATH at the driver's {want} library"}
    cc = find_compiler()
    if cc is None:
        return {**out, "passed": False, "error": "no C compiler to link with"}
    src = workdir / "link_probe.c"
    src.write_text("int cuInit(unsigned int); int probe(void) { return cuInit(0); }\n")
    # Newer Tritons (3.9 here: triton/backends/nvidia/driver.py's libraries) link with
    # -l:libcuda.so.1; older ones with -lcuda, which needs an unversioned libcuda.so. Either is enough here: the triton_kernel check
    # launches a real kernel with whichever this Triton uses.
    links = {}
    for flag in LINK_FLAGS:
        ok, log = _cc(cc, [str(src), "-shared", "-fPIC", "-o", str(workdir / "link_probe.so"),
                           *[f"-L{d}" for d in dirs], flag], workdir)
        links[flag] = ok
        if not ok:
            out.setdefault("linker_output", {})[flag] = log
    out["links"] = links
    out["passed"] = any(links.values())
    if not out["passed"]:
        out["error"] = (f"linking with {' or '.join(LINK_FLAGS)} failed in {dirs} (see linker_output): point "
                        "TRITON_LIBCUDA_PATH at the folder of the driver's libcuda.so.1")
    elif not links["-lcuda"]:
        out["warning"] = (f"-lcuda does not link (no unversioned libcuda.so in {dirs}); -l:libcuda.so.1 does, "
                          "which is what newer Tritons use. A Triton that links with -lcuda would fail its launcher "
                          "build: triton_kernel shows which")
    return out


def check_triton_kernel(dry_run: bool) -> dict:
    """Launch a 16-element kernel (first launch: compile + launcher build) and check its result."""
    if dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        return {"passed": False, "error": "the dry run needs TRITON_INTERPRET=1 set before triton is imported"}
    t = time.perf_counter()
    try:
        import torch
        import triton
        from gpu_check_triton_probe import add16

        device = "cpu" if dry_run else "cuda"
        x = torch.arange(16, dtype=torch.float32, device=device)
        y = torch.full((16,), 0.5, dtype=torch.float32, device=device)
        out = torch.full((16,), float("nan"), dtype=torch.float32, device=device)
        add16[(1,)](x, y, out, N=16)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t
        ok = bool(torch.equal(out.cpu(), x.cpu() * 2.0 + 0.5))
        t2 = time.perf_counter()
        add16[(1,)](x, y, out, N=16)
        if device == "cuda":
            torch.cuda.synchronize()
        return {"passed": ok, "device": device, "interpreted": dry_run, "triton": triton.__version__,
                "first_launch_seconds_including_compile": first, "second_launch_seconds": time.perf_counter() - t2,
                **({} if ok else {"error": "the kernel's result is wrong"})}
    except Exception as exc:  # noqa: BLE001 - the whole point: say what broke
        import traceback

        return {"passed": False, "error": f"{type(exc).__name__}: {exc}", "traceback": _tail(traceback.format_exc(), 3000),
                "seconds": time.perf_counter() - t}


def _requirement_problems(dist: str) -> list[str]:
    """Requirements of ``dist`` (no extras) that the installed distributions do not meet."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    problems = []
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = common.dist_version(req.name)
        if have is None:
            problems.append(f"{dist} needs {req}, not installed")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist} needs {req}, have {have}")
    return problems


def check_service_packages() -> dict:
    found, missing, problems = {}, [], []
    for dist, module in common.SERVICE_MODULES.items():
        if importlib.util.find_spec(module) is None:
            missing.append(dist)
            continue
        found[dist] = common.dist_version(dist)
        problems += _requirement_problems(dist) if found[dist] else []
    out = {"found": found, "missing": missing, "requirement_problems": problems,
           "passed": not missing and not problems}
    if not out["passed"]:
        out["error"] = ("the service cannot start here: " + "; ".join(
            ([f"missing {', '.join(missing)} (carry them: scripts/gpu_prepare.sh)"] if missing else []) + problems))
    return out


def run(out_dir: Path, mnist_dir: Path | None = None, dry_run: bool = False, log=print,
        report: dict | None = None, **_) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {} if report is None else report  # gpu_check.py's: what is in it survives an interrupt
    report.update({"mode": common.mode_name(dry_run), "checks": {}})
    checks = report["checks"]

    def finish(report: dict) -> None:
        failed = [name for name in BLOCKING if name in checks and not checks[name]["passed"]]
        report["failed_blocking"] = failed
        report["passed"] = not failed
        report["seconds"] = time.perf_counter() - t0

    with common.kept(report, out_dir / "precheck.json", finish):
        report["versions"] = common.versions()
        import torch

        if not dry_run:
            ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
            checks["cuda"] = {"passed": ok, "device_count": torch.cuda.device_count()}
            if not ok:
                checks["cuda"]["error"] = "torch sees no CUDA GPU (use --dry-run on a machine without one)"
        with tempfile.TemporaryDirectory(prefix="rev88-precheck-") as tmp:
            work = Path(tmp)
            checks["python_h"] = check_python_h()
            checks["c_compiler"] = check_compiler()
            checks["python_extension"] = check_python_extension(work)
            if not dry_run:
                checks["libcuda"] = check_libcuda(work)
        if dry_run or checks["cuda"]["passed"]:
            checks["triton_kernel"] = check_triton_kernel(dry_run)
        else:
            checks["triton_kernel"] = {"passed": False, "error": "not tried: no CUDA GPU"}
        checks["service_packages"] = check_service_packages()
        if dry_run:
            report["not_checked_in_dry_run"] = ["cuda", "libcuda (no driver here)",
                                                "the kernel's GPU compile and launcher build (interpreter only)"]
        for name, check in checks.items():
            flag = "ok  " if check["passed"] else ("FAIL" if name in BLOCKING else "warn")
            why = check.get("error") if not check["passed"] else check.get("warning")
            log(f"  precheck {flag} {name}" + (f": {why}" if why else ""))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = run(args.out, dry_run=args.dry_run)
    print(json.dumps({k: report[k] for k in ("passed", "failed_blocking", "seconds")}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
