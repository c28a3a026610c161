"""What a device call needs from here, checked before anything touches the GPU.

The GPU machine has no network: everything scripts/gpu_device_run.sh uses travels with the call,
either in the working tree (the scripts, learner/, app/, rev88/, data/mnist) or in ``carry``
(.device-wheels/ and .device-reference/, which git ignores). This script checks that it all arrived:

  wheels  (only when the service section runs) the folder holds exactly one wheel of each
          name==version in scripts/device_wheels.txt, each a readable zip with a .dist-info,
          and no other version of those packages (two versions of one package stop pip's install)
  mnist   the four MNIST files in $REV88_MNIST_DIR, else data/mnist (learner/data.py's rule, which
          scripts/gpu_check.py follows too): present, not empty, gzip or IDX (a Git LFS pointer or
          a truncated copy is caught here; gpu_check.py verifies their checksums later)
  reference  (only when the cuda, fused or tune section runs) the cpu backend's predictions the GPU
          runs compare with (.device-reference/cpu_reference.npz, scripts/gpu_reference.py, made
          by scripts/gpu_prepare.sh): a readable npz holding the eleven draws' predictions and task
          digests and the launch's (whether the device's tasks are its tasks is checked there,
          task by task; one that is not is compared with the cpu backend run on the device host)
  sections  every name in --sections is one of scripts/gpu_check.py's
  packages  every distribution the service imports (gpu_check_common.SERVICE_MODULES, measured by
          tests/test_device_packages.py) is on the GPU image (scripts/gpu_image_packages.txt) or
          pinned in scripts/device_wheels.txt; every pin lies in pyproject.toml's range for it and
          in app/http/versions.TESTED's releases; with the wheels folder, every carried wheel's own
          requirements (Requires-Dist, with the extras pyproject asks for) are met by the pins or
          the image, at a version that satisfies them where the version is known

With ``--here`` (scripts/gpu_prepare.sh) it also sums what the call will carry: the files git
would send (tracked, and untracked but not ignored) plus the carried folders, at most 64 MiB.

    python3 scripts/gpu_carried.py [--sections S] [--wheels DIR] [--reference NPZ] [--mnist-dir DIR] [--here]
    python3 scripts/gpu_carried.py --wheels-only [--wheels DIR]

Exit status 0 when everything is there, 1 with one line per problem (scripts/gpu_device_run.sh
then refuses to start: its exit status 6). Only the standard library: on the device this runs
before the wheels are installed.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
PINS_FILE = SCRIPTS / "device_wheels.txt"
IMAGE_FILE = SCRIPTS / "gpu_image_packages.txt"
PYPROJECT = ROOT / "pyproject.toml"
DEFAULT_WHEELS = ".device-wheels"
TRAVEL_LIMIT_BYTES = 64 * 2**20  # the device tool's limit on the working tree plus what is carried
PREPARE = "bash scripts/gpu_prepare.sh"
# The sections of scripts/gpu_check.py (kept equal to gpu_check.SECTIONS by a test; not imported,
# so that this script stays independent of the check it guards).
SECTIONS = ("precheck", "cuda", "energy", "fused", "service", "tune", "tests")
NEEDS_WHEELS = ("service",)
NEEDS_REFERENCE = ("cuda", "fused", "tune")
DEFAULT_REFERENCE = ".device-reference/cpu_reference.npz"
DRAWS = 11
# what scripts/gpu_reference.py writes (np.savez: one NAME.npy member per array)
REFERENCE_MEMBERS = ("format", "p0", "v0", "launch_pred", "launch_sha",
                     *(f"pred{k}" for k in range(DRAWS)), *(f"task_sha{k}" for k in range(DRAWS)))


def reference_problems(path: Path) -> list[str]:
    """Why the carried cpu reference is not there or not whole ([] when it is): a zip (npz) with
    every member scripts/gpu_reference.py writes. Only the standard library (no numpy here)."""
    fix = f"run `{PREPARE}` here (it makes {DEFAULT_REFERENCE} with scripts/gpu_reference.py) and carry its folder"
    if not path.is_file():
        return [f"no cpu reference {path}: the cuda, fused and tune sections compare with it; {fix}"]
    try:
        with zipfile.ZipFile(path) as z:
            names = {n.removesuffix(".npy") for n in z.namelist()}
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        return [f"{path} is not a readable npz ({exc}); {fix}"]
    missing = [m for m in REFERENCE_MEMBERS if m not in names]
    if bad is not None:
        return [f"{path}: member {bad} is corrupt; {fix}"]
    if missing:
        return [f"{path} lacks {', '.join(missing)} (not scripts/gpu_reference.py's, or a dry run's); {fix}"]
    return []


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


def read_image(path: Path = IMAGE_FILE) -> dict[str, str | None]:
    """scripts/gpu_image_packages.txt -> {normalized name: version, or None where not read}."""
    image: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[normalized(name.strip())] = version.strip() or None
    return image


def _load_by_path(name: str, path: Path):
    """A module of the checkout loaded by its path (no package import: numpy, torch stay out)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def service_distributions() -> list[str]:
    """The distributions the service imports: gpu_check_common.SERVICE_MODULES (measured by a test)."""
    common = _load_by_path("rev88_gpu_check_common", SCRIPTS / "gpu_check_common.py")
    return [normalized(name) for name in common.SERVICE_MODULES]


# -- versions and specifiers: packaging's where it is importable (the GPU image has it), else the
# -- small subset below (PEP 440 release numbers; ==, !=, ~=, <, <=, >, >=, ==X.*)

def _release_of(version: str) -> tuple[int, ...]:
    out = []
    for part in re.split(r"[.+]", version):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(out)


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def _simple_contains(spec: str, version: str) -> bool:
    have = _release_of(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.match(r"(===|==|!=|~=|<=|>=|<|>)\s*(.+)", clause).groups()
        if want.endswith(".*"):
            prefix = _release_of(want[:-2])
            same = have[:len(prefix)] == prefix
            if (op == "==") != same:
                return False
            continue
        a, b = _padded(have, _release_of(want))
        if op == "~=":
            upper = _release_of(want)[:-1]
            ok = a >= b and have[:len(upper)] == upper
        else:
            ok = {"==": a == b, "===": version == want, "!=": a != b, "<": a < b, "<=": a <= b,
                  ">": a > b, ">=": a >= b}[op]
        if not ok:
            return False
    return True


def spec_contains(spec: str, version: str) -> bool:
    """Whether ``version`` satisfies the specifier set ``spec`` ('' admits every version)."""
    if not spec.strip():
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return _simple_contains(spec, version)
    return SpecifierSet(spec).contains(version, prereleases=True)


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(\(?[^;()]*\)?)\s*(?:;(.*))?$")


def parse_requirement(text: str) -> tuple[str, set[str], str, str]:
    """'uvicorn[standard]>=0.55,<0.56 ; python_version>"3"' -> (name, extras, specifier, marker)."""
    match = _REQUIREMENT.match(text)
    if not match:
        raise ValueError(f"cannot read the requirement {text!r}")
    name, extras, spec, marker = match.groups()
    extras = {normalized(e.strip()) for e in (extras or "[]")[1:-1].split(",") if e.strip()}
    return normalized(name), extras, spec.strip().strip("()").strip(), (marker or "").strip()


def marker_holds(marker: str, extras: set[str]) -> bool | None:
    """Whether a requirement's marker holds on the GPU machine (CPython 3.12, Linux x86_64) when
    ``extras`` are asked for; None when it cannot be told without packaging."""
    if not marker:
        return True
    try:
        from packaging.markers import Marker
    except ImportError:
        only_extra = re.fullmatch(r"""extra\s*==\s*["']([^"']+)["']""", marker.strip())
        return normalized(only_extra.group(1)) in extras if only_extra else None
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix"}
    return any(Marker(marker).evaluate({**env, "extra": extra}) for extra in (extras or {""}))


def project_requirements(path: Path = PYPROJECT) -> dict[str, tuple[set[str], str]]:
    """pyproject.toml's runtime dependencies: {name: (extras asked for, specifier)}."""
    project = tomllib.loads(path.read_text())["project"]
    out = {}
    for text in project["dependencies"]:
        name, extras, spec, _ = parse_requirement(text)
        out[name] = (extras, spec)
    return out


def tested_releases() -> dict[str, tuple[tuple[int, ...], ...]]:
    """app/http/versions.TESTED: {name: the (major, minor) releases the tests ran on}."""
    versions = _load_by_path("rev88_http_versions", ROOT / "app" / "http" / "versions.py")
    return {normalized(name): releases for name, (releases, _) in versions.TESTED.items()}


def pin_problems(pins: dict[str, str], image: dict[str, str | None] | None = None) -> list[str]:
    """Why the pins and the image do not make the service's packages ([] when they do): a
    distribution the service imports that is neither on the image nor pinned, a pin outside
    pyproject.toml's range, a pin at a release app/http/versions.py was not tested on."""
    image = read_image() if image is None else image
    problems = []
    for name in service_distributions():
        if name not in image and name not in pins:
            problems.append(f"the service imports {name}, which is neither on the GPU image "
                            f"(scripts/gpu_image_packages.txt) nor in scripts/device_wheels.txt: pin it there")
    wanted = project_requirements()
    for name, version in pins.items():
        if name in wanted and not spec_contains(wanted[name][1], version):
            problems.append(f"scripts/device_wheels.txt pins {name}=={version}, outside pyproject.toml's "
                            f"{name}{wanted[name][1]}: pin a release in that range")
    for name, releases in tested_releases().items():
        if name in pins and _release_of(pins[name])[:2] not in releases:
            tested = ", ".join(".".join(map(str, r)) + ".x" for r in releases)
            problems.append(f"scripts/device_wheels.txt pins {name}=={pins[name]}, but app/http/versions.py "
                            f"was tested on {tested} only (rev88 serve would refuse to start)")
    return problems


def _wheel_metadata(path: Path):
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(wheel.read(name).decode("utf-8", "replace"))


def requirement_problems(folder: Path, pins: dict[str, str], image: dict[str, str | None] | None = None) -> list[str]:
    """Each carried wheel's own requirements (with the extras pyproject asks for) met by a pin or
    the image, at a satisfying version where the version is known ([] when they are)."""
    image = read_image() if image is None else image
    asked = {name: extras for name, (extras, _) in project_requirements().items()}
    problems = []
    for path in sorted(folder.glob("*.whl")):
        try:
            meta = _wheel_metadata(path)
        except (StopIteration, zipfile.BadZipFile, OSError):
            continue  # wheel_problems names it
        owner = normalized(meta.get("Name", path.name.split("-")[0]))
        for text in meta.get_all("Requires-Dist") or []:
            name, _, spec, marker = parse_requirement(text)
            holds = marker_holds(marker, asked.get(owner, set()))
            if not holds:
                continue
            have = pins.get(name, image.get(name))
            if name not in pins and name not in image:
                problems.append(f"{path.name} needs {text.strip()}, which is neither carried nor on the GPU image: "
                                f"pin it in scripts/device_wheels.txt")
            elif have is not None and not spec_contains(spec, have):
                where = "scripts/device_wheels.txt pins" if name in pins else "the GPU image has"
                problems.append(f"{path.name} needs {text.strip()}, but {where} {name}=={have}")
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
    parser.add_argument("--reference", type=Path, default=Path(DEFAULT_REFERENCE),
                        help=f"the carried cpu reference ({DEFAULT_REFERENCE})")
    parser.add_argument("--mnist-dir", type=Path, default=None, help="default: $REV88_MNIST_DIR, else data/mnist")
    parser.add_argument("--here", action="store_true", help="also sum what the call carries against 64 MiB")
    parser.add_argument("--wheels-only", action="store_true", help="check only the wheels folder (quietly)")
    args = parser.parse_args(argv)
    pins = read_pins()
    if args.wheels_only:
        return 1 if wheel_problems(args.wheels, pins) or pin_problems(pins) else 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] or list(SECTIONS)
    needs_wheels = any(s in NEEDS_WHEELS for s in sections)
    needs_reference = any(s in NEEDS_REFERENCE for s in sections)
    problems = section_problems(sections) + mnist_problems(args.mnist_dir)
    if needs_reference:
        problems += reference_problems(args.reference)
    if needs_wheels:
        problems += pin_problems(pins) + wheel_problems(args.wheels, pins)
        if args.wheels.is_dir():
            problems += requirement_problems(args.wheels, pins)
    facts = ["MNIST: the four files"]
    if needs_wheels:
        facts.append(f"wheels: {len(pins)} in {args.wheels}, with the image's {len(read_image())} packages "
                     f"every one the service imports")
    else:
        facts.append(f"wheels: not needed (no service section in {', '.join(sections)})")
    if needs_reference:
        facts.append(f"cpu reference: {args.reference}")
    if args.here:
        carried = [p for p in (args.wheels, args.reference.parent) if p.exists()]
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
