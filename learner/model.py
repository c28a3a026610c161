"""The rev88 model: input lift, the reversible additive-coupling core, the head.

    h      = [4*x - 0.5, 0]                     (N, 82): 81 pixels and one zero
    left   = h[:, :41],  right = h[:, 41:]
    block b:  left  = left  + alpha * relu(right) @ W[2b].T
              right = right + alpha * relu(left)  @ W[2b+1].T
    scores = [left, right] @ head.weight.T + head.bias

The core's backward does not keep activations: ``ReversibleCore`` saves only
the endpoint (one (N, 82) tensor) and the weights, and rebuilds each earlier
state by subtracting the branch it added, holding one branch's graph at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .shape import CLASSES, FEATURES, WIDTH, parameter_count  # noqa: F401 - (the shape's numbers: re-exported)


def lift(images: torch.Tensor) -> torch.Tensor:
    """(N,1,9,9) pixels in [0,1] -> (N,82): normalize 4*x-0.5, append one zero column."""
    x = images.reshape(images.shape[0], 81) * 4 - 0.5
    return torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)


def lift_into(out: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """In-place ``lift`` into a preallocated (N,82) buffer (no allocation: graph friendly)."""
    n = images.shape[0]
    torch.mul(images.reshape(n, 81), 4, out=out[:, :81])
    out[:, :81].sub_(0.5)
    out[:, 81].zero_()
    return out


def branch(x: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """One coupling branch: alpha * relu(x) @ weight.T (alpha first, as specified)."""
    return alpha * F.relu(x) @ weight.t()


def core_forward(h: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """The plain (autograd-recording) forward of the core."""
    left, right = h[:, :WIDTH], h[:, WIDTH:]
    for b in range(len(weights) // 2):
        left = left + branch(right, weights[2 * b], alpha)
        right = right + branch(left, weights[2 * b + 1], alpha)
    return torch.cat([left, right], dim=1)


def core_inverse(z: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Recover the core's input from its endpoint by subtracting each branch in reverse."""
    left, right = z[:, :WIDTH], z[:, WIDTH:]
    for b in reversed(range(len(weights) // 2)):
        right = right - branch(left, weights[2 * b + 1], alpha)
        left = left - branch(right, weights[2 * b], alpha)
    return torch.cat([left, right], dim=1)


def _branch_grads(x, weight, alpha, grad_out, need_x: bool):
    """Gradients of sum(grad_out * branch(x, weight)) w.r.t. x and weight, from a
    short-lived local graph (the only graph held at that moment)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(need_x)
        w = weight.detach().requires_grad_(True)
        out = branch(x, w, alpha)
        inputs = (x, w) if need_x else (w,)
        grads = torch.autograd.grad(out, inputs, grad_out)
    return grads if need_x else (None, grads[0])


class ReversibleCore(torch.autograd.Function):
    """Core forward saving only the endpoint; backward reconstructs by subtraction."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, alpha: float, *weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = core_forward(h, list(weights), alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(z, *weights)
        return z

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        z, *weights = ctx.saved_tensors
        alpha = ctx.alpha
        left, right = z[:, :WIDTH], z[:, WIDTH:]
        g_left, g_right = grad_z[:, :WIDTH], grad_z[:, WIDTH:]
        grads_w: list[torch.Tensor | None] = [None] * len(weights)
        for b in reversed(range(len(weights) // 2)):
            w_l, w_r = weights[2 * b], weights[2 * b + 1]
            # right_out = right_in + branch(left_out, w_r)
            with torch.no_grad():
                right = right - branch(left, w_r, alpha)
            g_x, grads_w[2 * b + 1] = _branch_grads(left, w_r, alpha, g_right, True)
            g_left = g_left + g_x
            # left_out = left_in + branch(right_in, w_l)
            with torch.no_grad():
                left = left - branch(right, w_l, alpha)
            g_x, grads_w[2 * b] = _branch_grads(right, w_l, alpha, g_left, True)
            g_right = g_right + g_x
        grad_h = torch.cat([g_left, g_right], dim=1) if ctx.needs_input_grad[0] else None
        return (grad_h, None, *grads_w)


def reversible_core(h: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    return ReversibleCore.apply(h, alpha, *weights)


def head(z: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor) -> torch.Tensor:
    return F.linear(z, head_weight, head_bias)


def scores(
    h: torch.Tensor, params: list[torch.Tensor], alpha: float, reversible: bool = True
) -> torch.Tensor:
    """Head scores for lifted inputs; params = [weights.0 .. weights.{2d-1}, head.weight, head.bias]."""
    weights, hw, hb = params[:-2], params[-2], params[-1]
    z = reversible_core(h, weights, alpha) if reversible else core_forward(h, weights, alpha)
    return head(z, hw, hb)
