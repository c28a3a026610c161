"""CPU package energy from RAPL (/sys/class/powercap), for the CPU backends' timing-only
measurements. Not GPU energy, and the whole machine's packages (other processes included)."""

from __future__ import annotations

from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
RAPL_LABEL = (
    "CPU package energy from RAPL (/sys/class/powercap): every package domain, the whole machine's "
    "CPU packages including other processes; not idle-adjusted; not GPU energy"
)


def rapl_packages(root: Path = POWERCAP) -> tuple[dict[str, tuple[Path, int]] | None, str | None]:
    """The package-level RAPL domains ({name: (energy_uj path, max_energy_range_uj)}), or why not."""
    if not root.is_dir():
        return None, f"{root} does not exist (no RAPL powercap interface)"
    domains: dict[str, tuple[Path, int]] = {}
    for zone in sorted(root.glob("*-rapl:*")):
        if zone.name.count(":") != 1:  # sub-zones (core, uncore, dram) are inside a package
            continue
        try:
            name = (zone / "name").read_text().strip()
            if not name.startswith("package"):
                continue
            max_range = int((zone / "max_energy_range_uj").read_text())
            int((zone / "energy_uj").read_text())
        except (OSError, ValueError) as exc:
            return None, f"RAPL zone {zone} is not readable: {exc}"
        domains[f"{zone.name}:{name}"] = (zone / "energy_uj", max_range)
    if not domains:
        return None, f"no RAPL package zones under {root}"
    return domains, None


def rapl_read(domains: dict[str, tuple[Path, int]]) -> dict[str, int]:
    return {name: int(path.read_text()) for name, (path, _) in domains.items()}


def rapl_delta_j(domains: dict[str, tuple[Path, int]], start: dict[str, int], end: dict[str, int]) -> float:
    """Joules between two readings, summed over packages; each counter wraps to 0 after
    reaching its max_energy_range_uj (one wrap at most between readings is assumed)."""
    total_uj = 0
    for name, (_, max_range) in domains.items():
        delta = end[name] - start[name]
        if delta < 0:
            delta += max_range
        total_uj += delta
    return total_uj / 1e6
