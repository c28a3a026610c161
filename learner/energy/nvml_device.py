"""Every NVML access of the project.

``NvmlMeter`` reads a real GPU through pynvml (package nvidia-ml-py): the cumulative energy
counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded),
instantaneous power, a little telemetry, the compute processes on the device and the
hardware's identity, on the process's monotonic clock (``time.perf_counter``: on Linux
CLOCK_MONOTONIC, one clock for every process of the machine, which the separate power
sampler (sampler.py) relies on). Everything here degrades to ``None`` plus a reason that says
what is missing (no pynvml, no NVML library, no driver, no GPU, no energy counter).

The NVML handle of a CUDA device is chosen by its PCI bus id, else by its UUID (torch's
device uuid against ``nvmlDeviceGetUUID``); the choice is recorded as
``nvml_handle_selected_by`` in ``hardware()``. The selection is tested with a fake pynvml
(tests/test_energy.py).

Power for the sampler: ``nvmlDeviceGetPowerUsage`` is, on GPUs newer than GA100, an average
over about one second (NVML's documentation); ``power_reader`` prefers the instantaneous
field ``NVML_FI_DEV_POWER_INSTANT`` where the driver answers it and says which it used.

Not verifiable on the development machine (no GPU, no NVML library): every code path of
``NvmlMeter``, ``open_meter``, ``power_reader`` and ``gpu_telemetry`` past NVML's
initialization against a real driver. scripts/gpu_check_energy.py exercises them on a GPU.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .meter import Meter

T = TypeVar("T")

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
    """A real GPU through NVML. Construct with ``open_meter``.

    ``power_w`` uses ``power_reader``'s choice (the instantaneous field where the driver answers
    it, else nvmlDeviceGetPowerUsage), chosen at the first read; ``power_query`` says which.
    ``counter_update_s`` is None until ``measure_counter_update`` has watched the counter
    (counter.py); then the measured period, which ``request.request_energy`` judges windows by."""

    def __init__(self, pynvml: Any, device: _Device) -> None:
        self._nv = pynvml
        self._device = device
        self._hardware: dict | None = None
        self._power: Callable[[], float] | None = None
        self.power_query: str | None = None
        self.counter_update_s: float | None = None
        self.counter_update_source: str | None = None
        self.counter_update: dict | None = None

    def energy_mj(self) -> int:
        return int(self._nv.nvmlDeviceGetTotalEnergyConsumption(self._device.handle))

    def power_w(self) -> float:
        if self._power is None:
            self._power, self.power_query = power_reader(self._nv, self._device.handle)
        return self._power()

    def measure_counter_update(self, cap_s: float | None = None) -> dict:
        """Watch the energy counter (the device idle) and keep its update period; the result of
        ``counter.measure_update_period``. Blocks for at most ``cap_s`` (default counter.CAP_S)."""
        from .counter import CAP_S, measure_update_period

        found = measure_update_period(self, time.sleep, CAP_S if cap_s is None else cap_s)
        self.counter_update = found
        if found["period_s"] is not None:
            self.counter_update_s = found["period_s"]
            self.counter_update_source = (f"measured: median of {len(found['intervals_s'])} interval(s) between the "
                                          f"counter's changes over {found['watched_s']:.3f} s at idle")
        return found

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

    def compute_processes(self) -> list[int]:
        """The PIDs NVML lists as compute processes on this device (raises NVMLError when the
        query fails; the caller records that as a check that could not be made)."""
        nv = self._nv
        return [int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(self._device.handle)]

    def sampler_target(self) -> dict:
        """What a separate sampler process needs to open the same device by itself."""
        return {"nvml_pci_bus_id": self._device.nvml_pci_bus_id,
                "uuid": _try(lambda: _text(self._nv.nvmlDeviceGetUUID(self._device.handle)))}


# Union member of nvmlValue_t for each NVML_VALUE_TYPE_* (pynvml's c_nvmlValue_t field names).
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def power_reader(nv: Any, handle: Any) -> tuple[Callable[[], float], str]:
    """A function returning the device's power in watts, and which NVML query it uses: the
    instantaneous field (NVML_FI_DEV_POWER_INSTANT, milliwatts) where one trial read answers it,
    else nvmlDeviceGetPowerUsage (on GPUs newer than GA100 a ~1 s average, which smears a
    window's edges)."""

    def instant() -> float:
        value = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
        if value.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(value.nvmlReturn)
        return float(getattr(value.value, _VALUE_FIELDS.get(value.valueType, "uiVal"))) / 1000.0

    def average() -> float:
        return nv.nvmlDeviceGetPowerUsage(handle) / 1000.0

    if hasattr(nv, "NVML_FI_DEV_POWER_INSTANT") and hasattr(nv, "nvmlDeviceGetFieldValues"):
        try:
            instant()
            return instant, "NVML_FI_DEV_POWER_INSTANT (instantaneous)"
        except nv.NVMLError:
            pass
    return average, "nvmlDeviceGetPowerUsage (a ~1 s average on GPUs newer than GA100)"


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


