"""The reference workload of the gated protocol: a dense fp32 matmul whose energy per FLOP and
speed are known for a healthy board, so a sensor that reads wrong (or a throttled board) shows.

``TorchMatmulReference`` multiplies two seeded n x n fp32 matrices (n = 4096 on a device:
2 n^3 = 1.37e11 FLOP per call) with TF32 off (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32`` False and float32 matmul precision "highest" for the
window, restored after; the settings are read back and recorded) and checks the product:
``check`` recomputes evenly spaced rows in float64 on the CPU and reports the largest absolute
error and the rms of the exact rows. The gate allows a relative error (max error / rms) of
1e-4. Measured on the CPU with these inputs at n = 4096: fp32 1.7e-6; the same product with
both inputs rounded to TF32's 10 mantissa bits 1.1e-3 (tests/test_energy_gated.py repeats this
at n = 512: 1.4e-6 and 8.5e-4). So the check also shows TF32 was off, not only requested off.
cuBLAS's fp32 error on a device is expected to be of the CPU's order; not yet measured.

Not verified on hardware: the CUDA path (no GPU here); the same class runs on the CPU in the
simulated board with n = 64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

N_DEVICE = 4096
ROWS_CHECKED = 8
SEED = 20260914


def matmul_flops(n: int) -> int:
    return 2 * n**3


@contextlib.contextmanager
def tf32_off() -> Iterator[dict]:
    """TF32 off for cuBLAS and cuDNN and fp32 matmuls at full precision; yields the settings as
    read back inside the block; restores the previous ones after."""
    import torch

    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield {
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous[0], previous[1]
        torch.set_float32_matmul_precision(previous[2])


def tf32_settings_off(settings: dict | None) -> bool:
    return bool(settings) and settings.get("cuda_matmul_allow_tf32") is False \
        and settings.get("cudnn_allow_tf32") is False and settings.get("float32_matmul_precision") == "highest"


def _inputs(n: int, seed: int):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.rand(n, n, generator=gen, dtype=torch.float32) * 2 - 1
    b = torch.rand(n, n, generator=gen, dtype=torch.float32) * 2 - 1
    return a, b


def check_product(a, b, c, rows: int = ROWS_CHECKED) -> dict:
    """``c`` against float64 products of ``rows`` evenly spaced rows of ``a`` with ``b`` (all on the CPU)."""
    import torch

    n = a.shape[0]
    index = torch.linspace(0, n - 1, min(rows, n)).round().long()
    exact = a[index].double() @ b.double()
    got = c[index].double()
    error = float((got - exact).abs().max())
    rms = float(exact.pow(2).mean().sqrt())
    finite = bool(torch.isfinite(got).all()) and math.isfinite(error)
    return {"rows_checked": [int(i) for i in index], "max_abs_error": error if finite else None,
            "reference_rms": rms, "finite": finite}  # no NaN in a record: it must stay JSON


class TorchMatmulReference:
    """n x n fp32 matmuls on ``device``; ``run(calls)`` returns once the device has finished them."""

    def __init__(self, device: str = "cuda", n: int = N_DEVICE, seed: int = SEED) -> None:
        self.device_name, self.n, self.seed = str(device), n, seed
        self.flops_per_call = matmul_flops(n)
        self._settings: dict | None = None

    def prepare(self) -> None:
        import torch

        self.device = torch.device(self.device_name)
        self._a_cpu, self._b_cpu = _inputs(self.n, self.seed)
        self._a, self._b = self._a_cpu.to(self.device), self._b_cpu.to(self.device)
        self._c = torch.empty_like(self._a)
        self.run(1)  # warm-up: cuBLAS picks its kernel outside any window

    def run(self, calls: int) -> None:
        import torch

        with tf32_off() as settings:
            for _ in range(calls):
                torch.mm(self._a, self._b, out=self._c)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._settings = settings

    def check(self) -> dict:
        out = check_product(self._a_cpu, self._b_cpu, self._c.cpu())
        out["tf32_settings"] = self._settings
        return out

    def describe(self) -> dict:
        return {"workload": f"{self.n}x{self.n} fp32 matmul (torch.mm), TF32 off", "n": self.n,
                "flops_per_call": self.flops_per_call, "device": self.device_name, "seed": self.seed,
                "rows_checked": ROWS_CHECKED}


def output_relative_error(check: dict | None) -> float | None:
    """max |error| / rms of the exact rows; None where the check has no usable figures."""
    if not check or not check.get("finite"):
        return None
    rms = check.get("reference_rms")
    error = check.get("max_abs_error")
    if not isinstance(rms, (int, float)) or not isinstance(error, (int, float)) or not rms > 0 or math.isnan(error):
        return None
    return error / rms
