"""What a device call needs from here, checked before anything touches the GPU.

The GPU machine has no network: everything scripts/gpu_device_run.sh uses travels with the call,
either in the working tree (the scripts, learner/, app/, rev88/, data/mnist) or in ``carry``
(.device-wheels/, which git ignores). This script checks that it all arrived:

  wheels  (only when the service section runs) the folder holds exactly one wheel of each
          name==version in scripts/device_wheels.txt, each a readable zip with a .dist-info,
          and no other version of those packages (two versions of one package stop pip's install)
  mnist   the four MNIST files in $REV88_MNIST_DIR, else data/mnist (learner/data.py's rule, which
          scripts/gpu_check.py follows too): present, not empty, gzip or IDX (a Git LFS pointer or
          a truncated copy is caught here; gpu_check.py verifies their checksums later)
  sections  every name in --sections is one of scripts/gpu_check.py's

With ``--here`` (scripts/gpu_prepare.sh) it also sums what the call will carry: the files git
would send (tracked, and untracked but not ignored) plus the carried folder, at most 64 MiB.

    python scripts/gpu_carried.py [--sections S] [--wheels DIR] [--mnist-dir DIR] [--here]
    python scripts/gpu_carried.py --wheels-only [--wheels DIR]

Exit status 0 when everything is there, 1 with one line per problem (scripts/gpu_device_run.sh
then refuses to start: its exit status 6). Only the standard library: on the device this runs
before the wheels are installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
PINS_FILE = SCRIPTS / "device_wheels.txt"
DEFAULT_WHEELS = ".device-wheels"
TRAVEL_LIMIT_BYTES = 64 * 2**20  # the device tool's limit on the working tree plus what is carried
PREPARE = "bash scripts/gpu_prepare.sh"
# The sections of scripts/gpu_check.py (kept equal to gpu_check.SECTIONS by a test; not imported,
# so that this script stays independent of the check it guards).
SECTIONS = ("precheck", "cuda", "energy", "fused", "service")
NEEDS_WHEELS = ("service",)


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): 'Pydantic_Core' -> 'pydantic-core'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS_FILE) -> dict[str, str]:
    """scripts/device_wheels.txt -> {normalized name: version}."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{number}: {raw!r} is not name==version")
        pins[normalized(name.strip())] = version.strip()
    if not pins:
        raise ValueError(f"{path} names no wheels")
    return pins


def wheel_problems(folder: Path, pins: dict[str, str]) -> list[str]:
    """Why ``folder`` would not install the pinned wheels ([] when it would)."""
    fix = f"build them here with `{PREPARE}` and carry the folder"
    if not folder.is_dir():
        return [f"no wheels folder {folder}: the service section needs the {len(pins)} wheels of "
                f"scripts/device_wheels.txt; {fix}"]
    found: dict[str, list[tuple[str, Path]]] = {}
    problems = []
    for path in sorted(folder.glob("*.whl")):
        parts = path.name[:-len(".whl")].split("-")
        if len(parts) < 5:
            problems.append(f"{path} is not named like a wheel (name-version-python-abi-platform.whl)")
            continue
        found.setdefault(normalized(parts[0]), []).append((parts[1], path))
    for name, version in pins.items():
        have = found.get(name, [])
        others = sorted(v for v, _ in have if v != version)
        if others:
            problems.append(f"{folder} holds {name} {', '.join(others)}, not only the pinned {version} "
                            f"(two versions of one package stop the install); {fix}")
        pinned = [path.name for v, path in have if v == version]
        if not pinned:
            problems.append(f"{folder} lacks the wheel of {name}=={version}; {fix}")
        elif len(pinned) > 1:
            problems.append(f"{folder} holds {len(pinned)} wheels of {name}=={version} ({', '.join(pinned)}): "
                            f"keep one; {fix}")
    for name, have in found.items():
        for version, path in have:
            if name in pins and version != pins[name]:
                continue  # reported above
            if name not in pins:
                problems.append(f"{path.name} in {folder} is not in scripts/device_wheels.txt; remove it, or {fix}")
                continue
            try:
                with zipfile.ZipFile(path) as wheel:
                    if not any(n.endswith(".dist-info/METADATA") for n in wheel.namelist()):
                        problems.append(f"{path} has no .dist-info/METADATA: not a wheel; {fix}")
            except (zipfile.BadZipFile, OSError) as exc:
                problems.append(f"{path} cannot be read as a wheel ({exc}); {fix}")
    return problems


def _learner_data():
    """learner/data.py loaded by its path: its MNIST names and folder rule, without importing the
    learner package (numpy, torch)."""
    spec = importlib.util.spec_from_file_location("rev88_learner_data", ROOT / "learner" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GZIP_MAGIC = b"\x1f\x8b"
IDX_MAGIC = b"\x00\x00\x08"  # unsigned byte data; the fourth byte is the number of dimensions


def mnist_problems(folder: Path | None = None) -> list[str]:
    """Why the MNIST folder gpu_check.py will read is not complete ([] when it is)."""
    data = _learner_data()
    folder = Path(folder) if folder is not None else data.bundled_mnist_dir()
    where = f"the MNIST folder {folder} ({data.MNIST_ENV} if set, else data/mnist)"
    if not folder.is_dir():
        return [f"{where} does not exist: the checkout's data/mnist travels with the call; restore it "
                f"(git checkout -- data/mnist) or point {data.MNIST_ENV} at a folder with the four files"]
    by_name = {data.official_name(p): p for p in sorted(folder.iterdir()) if p.is_file()}
    problems = []
    for name in data.MNIST_SHA256:
        path = by_name.get(name)
        if path is None:
            problems.append(f"{where} lacks {name} (or {name}.gz)")
            continue
        with open(path, "rb") as fh:
            head = fh.read(4)
        magic = GZIP_MAGIC if path.name.endswith(".gz") else IDX_MAGIC
        if not head:
            problems.append(f"{path} is empty")
        elif not head.startswith(magic):
            problems.append(f"{path} is not {'gzip' if magic == GZIP_MAGIC else 'IDX'} data "
                            f"(a Git LFS pointer or another file?): restore it with git checkout -- {path}")
    return problems


def section_problems(sections: list[str]) -> list[str]:
    unknown = [s for s in sections if s not in SECTIONS]
    return [f"unknown section(s) {', '.join(unknown)} in SECTIONS; choose from {', '.join(SECTIONS)}"] if unknown else []


def travelling_bytes(root: Path, carried: list[Path]) -> tuple[int, int, int]:
    """(files, bytes of the working tree git sends, bytes of the carried paths)."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True, timeout=60).stdout
    tree = {root / name for name in listed.decode().split("\0") if name}
    tree_files = [p for p in tree if p.is_file()]  # a tracked file deleted here does not travel
    extra = []
    for path in carried:
        path = path if path.is_absolute() else root / path
        extra += [p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file() and p not in tree]
    return (len(tree_files) + len(extra), sum(p.stat().st_size for p in tree_files),
            sum(p.stat().st_size for p in extra))


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="", help="comma-separated sections of the run (default: all)")
    parser.add_argument("--wheels", type=Path, default=Path(DEFAULT_WHEELS), help=f"the wheels folder ({DEFAULT_WHEELS})")
    parser.add_argument("--mnist-dir", type=Path, default=None, help="default: $REV88_MNIST_DIR, else data/mnist")
    parser.add_argument("--here", action="store_true", help="also sum what the call carries against 64 MiB")
    parser.add_argument("--wheels-only", action="store_true", help="check only the wheels folder (quietly)")
    args = parser.parse_args(argv)
    pins = read_pins()
    if args.wheels_only:
        return 1 if wheel_problems(args.wheels, pins) else 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] or list(SECTIONS)
    needs_wheels = any(s in NEEDS_WHEELS for s in sections)
    problems = section_problems(sections) + mnist_problems(args.mnist_dir)
    if needs_wheels:
        problems += wheel_problems(args.wheels, pins)
    facts = ["MNIST: the four files"]
    if needs_wheels:
        facts.append(f"wheels: {len(pins)} in {args.wheels}")
    else:
        facts.append(f"wheels: not needed (no service section in {', '.join(sections)})")
    if args.here:
        carried = [args.wheels] if args.wheels.exists() else []
        try:
            files, tree, extra = travelling_bytes(ROOT, carried)
        except (OSError, subprocess.SubprocessError) as exc:
            problems.append(f"could not list what the call carries with git ({exc})")
        else:
            facts.append(f"travels: {files} files, {mib(tree + extra)} of {mib(TRAVEL_LIMIT_BYTES)} "
                         f"(working tree {mib(tree)}, carried {mib(extra)})")
            if tree + extra > TRAVEL_LIMIT_BYTES:
                problems.append(f"the call would carry {mib(tree + extra)}, over the device tool's "
                                f"{mib(TRAVEL_LIMIT_BYTES)}: remove large untracked files or git-ignore them")
    if problems:
        print(f"gpu_carried: refusing to start, {len(problems)} problem(s) with what the call carries:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("gpu_carried: everything the call needs is here; " + "; ".join(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
