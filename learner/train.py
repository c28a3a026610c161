"""Seed-only initialization, seed-only shuffles, and the SGD-momentum loop.

Every backend follows exactly this meaning; the cpu backend runs it as written.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import permutations, seed_state
from .cancel import CancelToken, check
from .config import Config
from .errors import TrainingDivergedError
from .model import CLASSES, FEATURES, WIDTH, lift, parameter_count, scores  # noqa: F401 - (parameter_count: re-exported)
from .prepared import Prepared
from .taskio import TaskArrays


def parameter_names(depth: int) -> list[str]:
    return [f"weights.{i}" for i in range(2 * depth)] + ["head.weight", "head.bias"]


def initial_parameters(config: Config) -> list[torch.Tensor]:
    """float32 CPU tensors, from the seed alone: ``initial_arrays`` as tensors (the same memory)."""
    return [torch.from_numpy(a) for a in initial_arrays(config)]


def initial_arrays(config: Config) -> list[np.ndarray]:
    """The initial parameters, in order, drawn from a torch generator of their own.

    The same draws, in the same order, as seeding torch's global CPU generator and
    building ``nn.Linear(FEATURES, CLASSES)`` (its ``reset_parameters``: kaiming-uniform
    weight with a=sqrt(5), then a uniform bias in +-1/sqrt(fan_in)) -- byte-identical,
    but without touching global state, so threads may prepare tasks at the same time
    (the service's device thread and a backend self-check in another thread did race
    on the global generator when this used ``fork_rng`` + ``manual_seed``).

    The arrays share one float32 buffer, filled in place through tensors over it: one allocation
    instead of a torch call per parameter (each torch call lets go of the GIL and waits to take it
    back, which a busy service makes slow: docs/performance.md). Filling a contiguous view draws
    exactly what filling a tensor of its own would.
    """
    shapes = [(WIDTH, WIDTH)] * (2 * config.depth) + [(CLASSES, FEATURES), (CLASSES,)]
    memory = np.empty(parameter_count(config.depth), dtype=np.float32)
    arrays, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        arrays.append(memory[at:at + size].reshape(shape))
        at += size
    *weights, head_weight, head_bias = [torch.from_numpy(a) for a in arrays]
    gen = torch.Generator().manual_seed(config.seed)
    for w in weights:
        nn.init.normal_(w, 0.0, 0.05 / math.sqrt(WIDTH), generator=gen)
    nn.init.kaiming_uniform_(head_weight, a=math.sqrt(5), generator=gen)
    bound = 1.0 / math.sqrt(FEATURES)
    nn.init.uniform_(head_bias, -bound, bound, generator=gen)
    return arrays


def epoch_permutations(config: Config, n: int, cancel: CancelToken | None = None) -> list[np.ndarray]:
    """Epoch e trains in the order of the e-th permutation of one PCG64(seed) generator
    (numpy's ``Generator.permutation``; learner/permutations.py draws many seeds' at once)."""
    return permutations.epoch_permutations([config.seed], config.epochs, n, cancel)[0]


def batch_sizes(n: int, batch_size: int) -> list[int]:
    """Consecutive slices; the short last batch is included."""
    return [min(batch_size, n - start) for start in range(0, n, batch_size)]


def sgd_momentum_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    velocity: list[torch.Tensor],
    config: Config,
) -> None:
    """v = momentum*v + grad (+ weight_decay*p); p -= lr*v  (in place, as torch.optim.SGD)."""
    for p, g, v in zip(params, grads, velocity):
        if config.weight_decay != 0.0:
            g = g.add(p, alpha=config.weight_decay)
        v.mul_(config.momentum).add_(g)
        p.add_(v, alpha=-config.learning_rate)


def train_step(
    params: list[torch.Tensor],
    velocity: list[torch.Tensor],
    h_batch: torch.Tensor,
    y_batch: torch.Tensor,
    config: Config,
    reversible: bool = True,
) -> torch.Tensor:
    """One minibatch: mean cross-entropy, gradients, SGD-momentum update. Returns the loss."""
    leaves = [p.requires_grad_(True) for p in params]
    loss = F.cross_entropy(scores(h_batch, leaves, config.alpha, reversible), y_batch)
    grads = torch.autograd.grad(loss, leaves)
    with torch.no_grad():
        for p in params:
            p.requires_grad_(False)
        sgd_momentum_(params, list(grads), velocity, config)
    return loss.detach()


def train(
    params: list[torch.Tensor],
    train_h: torch.Tensor,
    train_y: torch.Tensor,
    orders: list[torch.Tensor],
    config: Config,
    reversible: bool = True,
    cancel: CancelToken | None = None,
) -> list[torch.Tensor]:
    """Train ``params`` in place from zero velocity; returns the final velocity.

    Stops early with TaskCancelled when ``cancel`` is cancelled (checked before every
    minibatch) and with TrainingDivergedError at the first non-finite loss.
    """
    velocity = [torch.zeros_like(p) for p in params]
    n = train_h.shape[0]
    done = 0
    for epoch, order in enumerate(orders):
        for step, start in enumerate(range(0, n, config.batch_size)):
            check(cancel, epoch, step)
            idx = order[start : start + config.batch_size]
            loss = train_step(params, velocity, train_h[idx], train_y[idx], config, reversible).item()
            if not math.isfinite(loss):
                raise TrainingDivergedError(
                    f"training diverged at epoch {epoch}, step {step}: non-finite loss ({loss}); "
                    "try a smaller learning_rate",
                    non_finite=["loss"], epoch=epoch, step=step,
                )
            done += 1
            if cancel is not None:
                cancel.progress[0] = done
    return velocity


@torch.no_grad()
def predict_scores(params: list[torch.Tensor], test_h: torch.Tensor, config: Config) -> torch.Tensor:
    return scores(test_h, params, config.alpha, reversible=False)


def train_predict(
    train_images: torch.Tensor,
    train_labels: torch.Tensor,
    test_images: torch.Tensor,
    initial: list[torch.Tensor],
    orders: list[torch.Tensor],
    config: Config,
    reversible: bool = True,
    cancel: CancelToken | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Fresh parameters, lift, train, score the queries: (params, velocity, scores)."""
    params = [p.detach().clone() for p in initial]
    train_h, test_h = lift(train_images), lift(test_images)
    velocity = train(params, train_h, train_labels, orders, config, reversible, cancel)
    check(cancel, len(orders), 0, len(orders))  # before scoring
    return params, velocity, predict_scores(params, test_h, config)


def prepare(task: TaskArrays, config: Config, cancel: CancelToken | None = None) -> Prepared:
    """Seed-derived initial parameters and epoch permutations (identical on every backend), with
    their hashes: computed once per (seed, shape) and kept (learner/seed_state.py); ``cancel``
    travels with them to the backend."""
    state = seed_state.states.get(config, task.train_count, cancel)
    return Prepared(config, state.initial, state.permutations, cancel, state.initial_sha256, state.permutation_sha256)


seed_state.states.compute = (initial_arrays, parameter_names)
