"""Reconstruction checks of the reversible core, as the reference records report them.

For fp64 and fp32 at depths 1 and 2, on identical weights and a 3-example batch:
the reversible forward must be bitwise equal to the plain forward; every input
and parameter gradient must match ordinary autograd within tolerance; the
inverse must recover the input; and the autograd node must hold exactly one
saved activation (the endpoint) plus 2*depth parameter references.
Computed once per process (``cached_validation``), not once per task.
"""

from __future__ import annotations

import functools

import torch

from .config import Config
from .model import WIDTH, core_forward, core_inverse, reversible_core
from .train import initial_parameters

TOLERANCES = {torch.float64: (2e-12, 2e-10), torch.float32: (2e-6, 3e-3)}
SCOPE = (
    "Identical weights; ordinary autograd versus custom reconstruction for inputs and every "
    "parameter. First-order differentiation only."
)


def _count_saved(h: torch.Tensor, weights: list[torch.Tensor], alpha: float):
    """Run the reversible core while recording what its autograd node saves."""
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = reversible_core(h, weights, alpha)
    weight_ptrs = {w.untyped_storage().data_ptr() for w in weights}
    activations = {}
    references = 0
    for t in packed:
        ptr = t.untyped_storage().data_ptr()
        if ptr in weight_ptrs:
            references += 1
        else:
            activations[ptr] = t.untyped_storage().nbytes()
    return out, len(activations), sum(activations.values()), references


def check(dtype: torch.dtype, depth: int, alpha: float = 0.5, batch: int = 3, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed + depth)
    # Generic core states, not lifted images: a lifted image has its appended zero
    # exactly on ReLU's kink, where the input gradient is a convention, and depth >= 2
    # reconstructs that zero only to rounding. Training never needs that input gradient.
    h0 = torch.randn(batch, 2 * WIDTH, generator=gen, dtype=torch.float64).to(dtype)
    # The learner's own seed-only initial weights (the weights it trains from).
    weights0 = [w.to(dtype) for w in initial_parameters(Config(depth=depth))[: 2 * depth]]
    cotangent = torch.randn(batch, 2 * WIDTH, generator=gen, dtype=torch.float64).to(dtype)

    def leaves():
        return h0.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in weights0]

    h_rev, w_rev = leaves()
    z_rev, storages, saved_bytes, references = _count_saved(h_rev, w_rev, alpha)
    g_rev = torch.autograd.grad((z_rev * cotangent).sum(), [h_rev, *w_rev])

    h_ref, w_ref = leaves()
    z_ref = core_forward(h_ref, w_ref, alpha)
    g_ref = torch.autograd.grad((z_ref * cotangent).sum(), [h_ref, *w_ref])

    atol, rtol = TOLERANCES[dtype]
    with torch.no_grad():
        forward_equal = bool(torch.equal(z_rev, z_ref))
        grad_err = max(float((a - b).abs().max()) for a, b in zip(g_rev, g_ref))
        grads_close = all(torch.allclose(a, b, atol=atol, rtol=rtol) for a, b in zip(g_rev, g_ref))
        inverse_err = float((core_inverse(z_ref, weights0, alpha) - h0).abs().max())
        inverse_ok = torch.allclose(core_inverse(z_ref, weights0, alpha), h0, atol=atol * 100, rtol=rtol)
    passed = forward_equal and grads_close and inverse_ok and storages == 1 and references == 2 * depth
    return {
        "dtype": str(dtype),
        "depth": depth,
        "passed": bool(passed),
        "forward_bitwise_equal": forward_equal,
        "maximum_gradient_abs_error": grad_err,
        "inverse_max_abs_error": inverse_err,
        "saved_activation_storages": storages,
        "saved_activation_bytes": saved_bytes,
        "saved_parameter_references": references,
    }


def run_validation(depths: tuple[int, ...] = (1, 2)) -> dict:
    checks = [check(dtype, depth) for dtype in (torch.float64, torch.float32) for depth in depths]
    return {
        "passed": all(c["passed"] for c in checks),
        "device": "cpu",
        "checks": checks,
        "scope": SCOPE,
    }


@functools.lru_cache(maxsize=1)
def cached_validation() -> dict:
    """The validation object, computed on first use and shared by every task of the process."""
    return run_validation()
