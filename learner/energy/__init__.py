"""Energy measurement's devices and meters: every NVML access of the project, the per-request
estimate, and the parts of the gated protocol that touch a device.

Modules: ``meter`` (the Meter interface, one stamped counter reading), ``nvml_device`` (NVML:
the meter of a real GPU, /health telemetry), ``counter`` (the counter's update period: how finely
it resolves a window), ``request`` (the per-request short-window estimate), ``rapl`` (CPU package energy), ``sampler`` (the power sampler process),
``reference`` (the reference matmul), ``simulated`` (simulated meters and the simulated board).
The protocols that use them are in ``learner.measure`` (paired-idle, gated, figures, gates,
analyze); nothing here imports them. Only the light modules are imported here (no torch).
docs/energy.md describes the gated protocol.
"""

from .counter import ASSUMED_UPDATE_S, counter_resolution, measure_update_period
from .meter import Meter, Reading, read
from .nvml_device import (
    NvmlMeter,
    cuda_pci_bus_id,
    cuda_uuid,
    driver_version,
    gpu_telemetry,
    normalize_uuid,
    nvml,
    open_meter,
    parse_pci_bus_id,
    power_reader,
)
from .rapl import POWERCAP, RAPL_LABEL, rapl_delta_j, rapl_packages, rapl_read
from .request import COUNTER_NOTE, GATED_DOC, MEASURED_UPDATES, IdleBaseline, request_energy
from .simulated import SimulatedMeter

__all__ = [
    "ASSUMED_UPDATE_S", "COUNTER_NOTE", "GATED_DOC", "MEASURED_UPDATES", "POWERCAP", "RAPL_LABEL", "IdleBaseline",
    "Meter", "NvmlMeter", "Reading", "SimulatedMeter", "counter_resolution", "cuda_pci_bus_id", "cuda_uuid",
    "driver_version", "gpu_telemetry", "measure_update_period",
    "normalize_uuid", "nvml", "open_meter", "parse_pci_bus_id", "power_reader", "rapl_delta_j", "rapl_packages",
    "rapl_read", "read", "request_energy",
]
