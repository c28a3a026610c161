"""Every NVML access of the project, behind one small interface.

``Meter`` is what the measurement code needs from a GPU: the cumulative energy
counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver
loaded), instantaneous power, a little telemetry, the hardware's identity and a
monotonic clock. ``NvmlMeter`` reads a real GPU through pynvml (package
nvidia-ml-py); ``SimulatedMeter`` is a scripted counter and clock, so the
protocol's arithmetic (learner/measure.py) can be tested on a machine without a
GPU. Everything here degrades to ``None`` plus a reason that says what is
missing (no pynvml, no NVML library, no driver, no GPU, no energy counter).

The NVML counter advances in steps (its update period is tens of ms), so the
energy of a window only a few periods long is an estimate; ``request_energy``
says so in its note, and the paired-idle protocol (``rev88 measure``) repeats
the task inside a window of seconds to get a figure worth comparing.

The NVML handle of a CUDA device is chosen by its PCI bus id, else by its UUID
(torch's device uuid against ``nvmlDeviceGetUUID``); the choice is recorded as
``nvml_handle_selected_by`` in ``hardware()``. The selection is tested with a fake
pynvml (tests/test_energy.py).

Not verifiable on the development machine (no GPU, no NVML library): every
code path of ``NvmlMeter``, ``open_meter`` and ``gpu_telemetry`` past NVML's
initialization against a real driver. scripts/gpu_check_energy.py exercises them on a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# Windows shorter than this span only a few updates of the NVML energy counter.
SHORT_WINDOW_S = 0.1
COUNTER_NOTE = (
    "NVML's total-energy counter (mJ) advances in steps of tens of ms; a window shorter than "
    f"{SHORT_WINDOW_S * 1000:.0f} ms covers only a few steps, so its energy is an estimate that can "
    "read 0 or include neighbouring work. Use `rev88 measure` (POST /tasks?measure=energy) for the "
    "paired-idle figure."
)


class Meter(Protocol):
    def energy_mj(self) -> int: ...

    def power_w(self) -> float: ...

    def telemetry(self) -> dict: ...

    def hardware(self) -> dict: ...

    def now(self) -> float: ...


# --------------------------------------------------------------------------- readings


@dataclasses.dataclass(frozen=True)
class Reading:
    """One counter reading, stamped at the midpoint of the clock reads around it."""

    energy_mj: int
    time_s: float
    query_latency_s: float

    def as_dict(self) -> dict:
        return {"energy_mj": self.energy_mj, "time_s": self.time_s, "query_latency_s": self.query_latency_s}


def read(meter: Meter) -> Reading:
    before = meter.now()
    energy = int(meter.energy_mj())
    after = meter.now()
    return Reading(energy, (before + after) / 2, after - before)


# --------------------------------------------------------------------------- NVML access

_lock = threading.RLock()
_nvml: Any = None  # the pynvml module once nvmlInit succeeded
_nvml_error: str | None = None  # why NVML cannot be used (cached: the answer does not change)
_default_device: _Device | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _init_reason(pynvml: Any, exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "the NVIDIA driver is not loaded"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "no permission to use NVML"
    return f"NVML could not start: {exc}"


def nvml() -> tuple[Any, str | None]:
    """The initialized pynvml module, or None and why (initialized once per process)."""
    global _nvml, _nvml_error
    with _lock:
        if _nvml is not None or _nvml_error is not None:
            return _nvml, _nvml_error
        try:
            import pynvml
        except ImportError:
            _nvml_error = "nvidia-ml-py (pynvml) is not installed"
            return None, _nvml_error
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            _nvml_error = _init_reason(pynvml, exc)
            return None, _nvml_error
        if count == 0:
            _nvml_error = "NVML sees no NVIDIA GPU"
            return None, _nvml_error
        _nvml = pynvml
        return _nvml, None


def _try(fn: Callable[[], T]) -> T | None:
    """One NVML query; ``None`` where the GPU does not support it or it fails."""
    try:
        return fn()
    except Exception as exc:  # pynvml.NVMLError and its subclasses (NotSupported, GpuIsLost, ...)
        if type(exc).__name__.startswith("NVMLError"):
            return None
        raise


def parse_pci_bus_id(text: str) -> tuple[int, int, int, int]:
    """'0000:50:00.0' (CUDA) and '00000000:50:00.0' (NVML) -> (domain, bus, device, function)."""
    domain, bus, rest = text.strip().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


def cuda_pci_bus_id(cuda_index: int) -> str | None:
    """The CUDA device's PCI address as CUDA writes it, e.g. '0000:50:00.0'."""
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    try:
        domain, bus, device = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    except AttributeError:  # an old torch without PCI fields
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def normalize_uuid(text: Any) -> str | None:
    """A GPU UUID as bare lower-case hex: NVML's 'GPU-6a0b...-...' and torch's '6a0b...-...'
    (or without dashes) compare equal."""
    if text is None:
        return None
    value = _text(text).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if value.startswith(prefix):
            value = value[len(prefix):]
    value = value.replace("-", "")
    return value or None


def cuda_uuid(cuda_index: int) -> str | None:
    """The CUDA device's UUID as torch reports it (normalized), or None where torch has none."""
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else normalize_uuid(str(uuid))


@dataclasses.dataclass
class _Device:
    handle: Any
    cuda_index: int | None
    cuda_pci_bus_id: str | None
    nvml_pci_bus_id: str
    selected_by_cuda_pci_bus_id: bool
    # how the handle was chosen: "pci_bus_id", "uuid" (the bus id did not match), "index"
    # (torch sees no CUDA device, or gives neither id: NVML's first device), or
    # "pci_bus_id_unverified" (the bus-id lookup answered a device whose id differs and the UUID
    # did not match either)
    selected_by: str = "pci_bus_id"
    cuda_uuid: str | None = None


def _by_uuid(pynvml: Any, uuid: str | None) -> Any:
    """The NVML handle whose UUID is ``uuid`` (normalized), or None."""
    if uuid is None:
        return None
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = _try(lambda i=i: pynvml.nvmlDeviceGetHandleByIndex(i))
        if handle is not None and normalize_uuid(_try(lambda h=handle: pynvml.nvmlDeviceGetUUID(h))) == uuid:
            return handle
    return None


def _select(pynvml: Any, cuda_index: int | None) -> tuple[_Device | None, str | None]:
    """The NVML handle of the CUDA device, chosen by its PCI bus id (CUDA and NVML
    number devices differently, e.g. under CUDA_VISIBLE_DEVICES), else by its UUID
    (torch's device uuid against nvmlDeviceGetUUID), so that a bus-id format or lookup
    difference does not lose the meter."""
    import torch

    cuda_bus = uuid = None
    if torch.cuda.is_available():
        if cuda_index is None:
            cuda_index = torch.cuda.current_device()
        if not 0 <= cuda_index < torch.cuda.device_count():
            return None, f"CUDA device {cuda_index} does not exist (torch sees {torch.cuda.device_count()})"
        cuda_bus = cuda_pci_bus_id(cuda_index)
        try:
            uuid = cuda_uuid(cuda_index)
        except Exception:  # noqa: BLE001 - an old torch, or a property it cannot read: no UUID fallback
            uuid = None
    elif cuda_index is not None:
        return None, f"CUDA device {cuda_index} was asked for but torch sees no CUDA device"

    handle, how, bus_error = None, None, None
    if cuda_bus is not None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(cuda_bus)
            nvml_bus = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            how = "pci_bus_id" if parse_pci_bus_id(cuda_bus) == parse_pci_bus_id(nvml_bus) else None
        except (pynvml.NVMLError, ValueError) as exc:
            handle, bus_error = None, exc
    if how is None and uuid is not None:
        try:
            by_uuid = _by_uuid(pynvml, uuid)
        except pynvml.NVMLError:
            by_uuid = None
        if by_uuid is not None:
            handle, how = by_uuid, "uuid"
    if how is None and handle is not None:
        how = "pci_bus_id_unverified"  # the lookup's answer, as before the UUID fallback
    if handle is None and cuda_bus is None and uuid is None:
        try:  # torch without CUDA (or without PCI fields and uuid): NVML's first device, and say so
            handle, how = pynvml.nvmlDeviceGetHandleByIndex(0), "index"
        except pynvml.NVMLError as exc:
            return None, f"NVML has no usable device at index 0: {exc}"
    if handle is None:
        tried = []
        if cuda_bus is not None:
            tried.append(f"CUDA's PCI bus id {cuda_bus}" + (f" ({bus_error})" if bus_error else ""))
        if uuid is not None:
            tried.append(f"CUDA's UUID {uuid}")
        return None, f"NVML has no usable device matching {' or '.join(tried)}"
    try:
        nvml_bus = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    except pynvml.NVMLError as exc:
        return None, f"NVML device chosen by {how} has no readable PCI info: {exc}"
    matched = how == "pci_bus_id"
    return _Device(handle, cuda_index, cuda_bus, nvml_bus, matched, how, uuid), None


class NvmlMeter:
    """A real GPU through NVML. Construct with ``open_meter``."""

    def __init__(self, pynvml: Any, device: _Device) -> None:
        self._nv = pynvml
        self._device = device
        self._hardware: dict | None = None

    def energy_mj(self) -> int:
        return int(self._nv.nvmlDeviceGetTotalEnergyConsumption(self._device.handle))

    def power_w(self) -> float:
        return self._nv.nvmlDeviceGetPowerUsage(self._device.handle) / 1000.0

    def telemetry(self) -> dict:
        nv, h = self._nv, self._device.handle
        power = _try(lambda: nv.nvmlDeviceGetPowerUsage(h))
        return {
            "temperature_c": _try(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            "power_w": None if power is None else power / 1000.0,
            "graphics_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_GRAPHICS)),
            "memory_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        }

    def hardware(self) -> dict:
        if self._hardware is None:
            self._hardware = _hardware(self._nv, self._device)
        return dict(self._hardware)

    def now(self) -> float:
        return time.perf_counter()


def _power_limit_w(nv: Any, h: Any) -> float | None:
    limit = _try(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
    if limit is None:
        limit = _try(lambda: nv.nvmlDeviceGetPowerManagementLimit(h))
    return None if limit is None else limit / 1000.0


def _hardware(nv: Any, device: _Device) -> dict:
    h = device.handle
    total = None
    if device.cuda_index is not None:  # the CUDA device's own figure, as torch reports it
        import torch

        total = int(torch.cuda.get_device_properties(device.cuda_index).total_memory)
    if total is None:
        info = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        total = None if info is None else int(info.total)
    return {
        "gpu": _try(lambda: _text(nv.nvmlDeviceGetName(h))),
        "uuid": _try(lambda: _text(nv.nvmlDeviceGetUUID(h))),
        "total_memory_bytes": total,
        "power_limit_w": _power_limit_w(nv, h),
        "driver": _try(lambda: _text(nv.nvmlSystemGetDriverVersion())),
        "cuda_pci_bus_id": device.cuda_pci_bus_id,
        "nvml_pci_bus_id": device.nvml_pci_bus_id,
        "nvml_handle_selected_by_cuda_pci_bus_id": device.selected_by_cuda_pci_bus_id,
        "nvml_handle_selected_by": device.selected_by,
        "cuda_uuid": device.cuda_uuid,
    }


def open_meter(cuda_index: int | None = None) -> tuple[Meter | None, str | None]:
    """A meter for the CUDA device ``cuda_index`` (default: the current one), or None and why."""
    nv, reason = nvml()
    if nv is None:
        return None, reason
    with _lock:
        device, reason = _select(nv, cuda_index)
    if device is None:
        return None, reason
    meter = NvmlMeter(nv, device)
    try:
        meter.energy_mj()
    except nv.NVMLError_NotSupported:
        name = _try(lambda: _text(nv.nvmlDeviceGetName(device.handle))) or "this GPU"
        return None, (
            f"{name} does not support NVML's total energy counter "
            "(nvmlDeviceGetTotalEnergyConsumption needs Volta or newer, and is unavailable on MIG instances)"
        )
    except nv.NVMLError as exc:
        return None, f"NVML energy counter unreadable: {exc}"
    return meter, None


def driver_version() -> str | None:
    """The NVIDIA driver version, or None where NVML is unavailable (for result metadata)."""
    nv, _ = nvml()
    return None if nv is None else _try(lambda: _text(nv.nvmlSystemGetDriverVersion()))


def _cuda_version(nv: Any) -> str | None:
    version = _try(nv.nvmlSystemGetCudaDriverVersion)
    return None if version is None else f"{version // 1000}.{version % 1000 // 10}"


def gpu_telemetry() -> tuple[dict | None, str | None]:
    """The /health ``gpu`` object, or None and why. NVML starts once and the device is
    chosen once; each call then costs a handful of NVML queries."""
    global _default_device
    nv, reason = nvml()
    if nv is None:
        return None, reason
    with _lock:
        if _default_device is None:
            device, reason = _select(nv, None)
            if device is None:
                return None, reason
            _default_device = device
        device = _default_device
    h = device.handle
    memory = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    utilization = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    power = _try(lambda: nv.nvmlDeviceGetPowerUsage(h))
    return {
        "name": _try(lambda: _text(nv.nvmlDeviceGetName(h))),
        "uuid": _try(lambda: _text(nv.nvmlDeviceGetUUID(h))),
        "driver": _try(lambda: _text(nv.nvmlSystemGetDriverVersion())),
        "cuda_version": _cuda_version(nv),
        "temperature_c": _try(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "power_w": None if power is None else power / 1000.0,
        "power_limit_w": _power_limit_w(nv, h),
        "energy_counter_mj": _try(lambda: int(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
        "graphics_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_GRAPHICS)),
        "memory_clock_mhz": _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        "memory_used_bytes": None if memory is None else int(memory.used),
        "memory_total_bytes": None if memory is None else int(memory.total),
        "utilization_percent": None if utilization is None else int(utilization.gpu),
    }, None


# --------------------------------------------------------------------------- simulation


class SimulatedMeter:
    """A scripted GPU: power is piecewise constant, the clock moves only when told.

    ``advance(seconds, power_w)`` lets ``seconds`` pass at ``power_w`` (default: the
    idle power); the counter integrates exactly and reads as whole millijoules,
    optionally only at multiples of ``update_period_s`` (as NVML's counter does).
    ``sleep`` is ``advance`` at idle power, for the protocol's settle/idle waits.
    """

    def __init__(
        self,
        idle_w: float = 60.0,
        start_mj: int = 1_000_000,
        start_s: float = 100.0,
        update_period_s: float = 0.0,
        hardware: dict | None = None,
    ) -> None:
        self.idle_w = idle_w
        self._t = float(start_s)
        self._energy_j = start_mj / 1000.0
        self._power_w = idle_w
        self.update_period_s = update_period_s
        self._updates: list[tuple[float, float]] = [(self._t, self._energy_j)]
        self._hardware = hardware or {
            "gpu": "simulated",
            "uuid": None,
            "total_memory_bytes": None,
            "power_limit_w": None,
            "driver": None,
            "cuda_pci_bus_id": None,
            "nvml_pci_bus_id": None,
            "nvml_handle_selected_by_cuda_pci_bus_id": False,
            "nvml_handle_selected_by": None,
        }

    def advance(self, seconds: float, power_w: float | None = None) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._power_w = self.idle_w if power_w is None else power_w
        self._energy_j += self._power_w * seconds
        self._t += seconds
        self._updates.append((self._t, self._energy_j))

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def energy_mj(self) -> int:
        energy = self._energy_j
        if self.update_period_s > 0:  # the value at the last update tick at or before now
            tick = (self._t // self.update_period_s) * self.update_period_s
            energy = self._energy_at(tick)
        return int(round(energy * 1000.0))

    def _energy_at(self, t: float) -> float:
        prev_t, prev_e = self._updates[0]
        for ut, ue in self._updates[1:]:
            if ut > t:
                rate = (ue - prev_e) / (ut - prev_t) if ut > prev_t else 0.0
                return prev_e + rate * (t - prev_t)
            prev_t, prev_e = ut, ue
        return prev_e

    def power_w(self) -> float:
        return self._power_w

    def telemetry(self) -> dict:
        return {"temperature_c": None, "power_w": self._power_w, "graphics_clock_mhz": None, "memory_clock_mhz": None}

    def hardware(self) -> dict:
        return dict(self._hardware)

    def now(self) -> float:
        return self._t


# --------------------------------------------------------------------------- per-request figures


class IdleBaseline:
    """Power samples taken while the device is idle; their median is the baseline
    subtracted from a request's energy. Bounded: the newest ``capacity`` samples."""

    def __init__(self, capacity: int = 60) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._samples: collections.deque[float] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def sample(self, meter: Meter) -> float | None:
        """Record the meter's power now; the caller makes sure the device is idle.
        A failed read is remembered in ``last_error`` and skipped."""
        try:
            watts = float(meter.power_w())
        except Exception as exc:  # a telemetry hiccup must not stop the sampler
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        with self._lock:
            self._samples.append(watts)
        return watts

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def median_w(self) -> float | None:
        with self._lock:
            return statistics.median(self._samples) if self._samples else None


def request_energy(meter: Meter, run: Callable[[], T], idle: IdleBaseline) -> tuple[T, dict]:
    """Counter and clock read around ``run`` (which must return only after the device
    finished its work, as ``backend.run`` does). Gross joules, and joules above the idle
    baseline where one has been sampled."""
    start = read(meter)
    result = run()
    end = read(meter)
    duration = end.time_s - start.time_s
    delta = end.energy_mj - start.energy_mj
    baseline = idle.median_w()
    note = COUNTER_NOTE
    if delta < 0:  # the counter restarted (driver reload): no figure
        gross = adjusted = None
        note = "the energy counter went backwards (driver reloaded?); no figure. " + note
    else:
        gross = delta / 1000.0
        adjusted = None if baseline is None else gross - baseline * duration
    if baseline is None:
        note = "no idle power sampled yet, so no idle-adjusted figure. " + note
    estimate = duration < SHORT_WINDOW_S
    if estimate:
        note = f"estimate: the {duration * 1000:.1f} ms window is shorter than {SHORT_WINDOW_S * 1000:.0f} ms. " + note
    return result, {
        "gross_j": gross,
        "idle_baseline_w": baseline,
        "idle_baseline_samples": len(idle),
        "idle_adjusted_j": adjusted,
        "duration_s": duration,
        "counter_start_mj": start.energy_mj,
        "counter_end_mj": end.energy_mj,
        "method": "nvml-total-energy-counter-delta",
        "estimate": estimate,
        "note": note,
    }


# --------------------------------------------------------------------------- CPU package energy (RAPL)

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
