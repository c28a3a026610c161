"""Independent eager reference: ordinary autograd through the plain core and torch.optim.SGD.

Used by tests and by scripts/gpu_check.py to judge other backends (never by a backend itself).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import Config
from .model import core_forward, head, lift
from .taskio import TaskArrays
from .train import epoch_permutations, initial_parameters

TOLERANCE = {"atol": 2e-5, "rtol": 3e-3}


def ordinary_sgd(task: TaskArrays, config: Config, device: str = "cpu"):
    """(final params, final velocity, scores) as numpy, from plain autograd and torch.optim.SGD."""
    params = [torch.nn.Parameter(p.clone().to(device)) for p in initial_parameters(config)]
    opt = torch.optim.SGD(params, lr=config.learning_rate, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    h = lift(torch.from_numpy(task.train_images).to(device))
    y = torch.from_numpy(task.train_labels).to(device)
    for perm in epoch_permutations(config, task.train_count):
        perm_t = torch.from_numpy(perm).to(device)
        for start in range(0, task.train_count, config.batch_size):
            idx = perm_t[start:start + config.batch_size]
            opt.zero_grad()
            z = core_forward(h[idx], params[:-2], config.alpha)
            F.cross_entropy(head(z, params[-2], params[-1]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        test_h = lift(torch.from_numpy(task.test_images).to(device))
        scores = head(core_forward(test_h, params[:-2], config.alpha), params[-2], params[-1])
    velocity = [opt.state[p].get("momentum_buffer") for p in params]
    as_np = lambda ts: [None if t is None else t.detach().cpu().numpy() for t in ts]  # noqa: E731
    return as_np(params), as_np(velocity), scores.cpu().numpy()


def max_violation(a: list[np.ndarray], b: list[np.ndarray], atol: float, rtol: float) -> tuple[bool, float]:
    """(all within tolerance, max abs error) over matching arrays; None entries are skipped."""
    ok, worst = True, 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        err = np.abs(x.astype(np.float64) - y.astype(np.float64))
        worst = max(worst, float(err.max()) if err.size else 0.0)
        ok = ok and bool(np.all(err <= atol + rtol * np.abs(y.astype(np.float64))))
    return ok, worst
