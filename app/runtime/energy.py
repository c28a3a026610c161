"""The service's GPU energy meters (learner.energy): one per worker's GPU, or why there are none,
and the idle power baseline of each.

Per GPU: the cold idle (power and clocks read when its meter opens, before the service gives it
any work: ``IdleBaseline.record_cold``), the idle samples taken between tasks (their median is
the baseline a per-request figure subtracts) and, on its worker's first idle moment, its energy
counter's update period, watched for at most learner.energy.counter.CAP_S (0.6 s) by a meter
that can (``measure_counter_update``: NVML); until then a request's window is judged by an
assumed period, and its figure says so (``counter_update_source``).
"""

from __future__ import annotations

from typing import Any

from .executor import current_worker


class Energy:
    """The GPU meters (learner.energy), one per worker's GPU, or why there are none; the idle
    power baseline of each."""

    def __init__(self) -> None:
        self.meters: dict[str, Any] = {}  # "cuda:0" -> meter
        self.idles: dict[str, Any] = {}
        self.counters: dict[str, dict] = {}  # "cuda:0" -> its counter's watched update period
        self.reason: str | None = "the energy meter has not been opened yet"
        self.request_energy: Any = None
        self.gpu_telemetry: Any = None
        self._idle_baseline: Any = None

    @property
    def meter(self) -> Any:
        """The first GPU's meter (None without one)."""
        return next(iter(self.meters.values()), None)

    @property
    def idle(self) -> Any:
        """The first GPU's idle baseline (one exists even without a meter)."""
        first = next(iter(self.idles.values()), None)
        return first if first is not None else self._idle_baseline

    def open(self, devices: list[str] | None = None) -> None:
        try:
            from learner import energy
        except ImportError as exc:  # a checkout without the energy module
            self.reason = f"learner.energy is unavailable: {exc}"
            return
        self.request_energy = energy.request_energy
        self.gpu_telemetry = energy.gpu_telemetry
        self._idle_baseline = energy.IdleBaseline()
        gpus = [d for d in devices or [] if d.startswith("cuda")]
        if not gpus:
            _meter, self.reason = energy.open_meter(None)
            if _meter is not None:  # a GPU exists but the workers are CPU ones: no per-task GPU energy
                self.reason = "the service's workers run on the CPU; GPU energy is measured for GPU backends only"
            return
        reasons = []
        for device in gpus:
            index = int(device.split(":", 1)[1])
            meter, reason = energy.open_meter(index)
            if meter is None:
                reasons.append(f"{device}: {reason}")
                continue
            self.meters[device] = meter
            self.idles[device] = energy.IdleBaseline()
            self.idles[device].record_cold(meter)  # before any work on this GPU
        self.reason = "; ".join(reasons) or None

    def _device(self, engine) -> str:
        device = str(engine.device)
        return "cuda:0" if device == "cuda" else device

    def meter_for(self, engine) -> tuple[Any, str | None]:
        if not str(engine.device).startswith("cuda"):
            return None, (
                f"backend {engine.name!r} runs on the CPU; the GPU energy counter (NVML) measures GPUs only"
                + (f" (and here: {self.reason})" if not self.meters and self.reason else "")
            )
        meter = self.meters.get(self._device(engine))
        if meter is None:
            return None, self.reason or f"no energy meter for {engine.device}"
        return meter, None

    def idle_for(self, engine) -> Any:
        idle = self.idles.get(self._device(engine))
        return idle if idle is not None else self.idle

    def telemetry(self) -> tuple[dict | None, str | None]:
        if self.gpu_telemetry is None:
            return None, self.reason
        return self.gpu_telemetry()

    def sample_idle(self) -> None:
        """On a worker: sample the idle power of that worker's GPU; the first time, watch its energy
        counter's update period first (the GPU is idle now)."""
        worker = current_worker()
        device = worker.device if worker is not None else next(iter(self.meters), None)
        meter = self.meters.get(device)
        if meter is None:
            return
        if device not in self.counters and callable(getattr(meter, "measure_counter_update", None)):
            try:
                self.counters[device] = meter.measure_counter_update()
            except Exception as exc:  # noqa: BLE001 - a telemetry hiccup: judged by the assumed period
                self.counters[device] = {"period_s": None, "reason": f"{type(exc).__name__}: {exc}"}
        self.idles[device].sample(meter)
