"""How much a task may cost: an estimate of its work and peak memory, checked against limits
before it runs (the service before it queues a task, ``rev88 run`` before it trains).

    work  = depth x (epochs x (N + 32 x steps_per_epoch) + M)      steps_per_epoch = ceil(N / batch_size)

counts rows pushed through the core, each minibatch step counted as 32 rows of fixed
overhead (the update, the Python or kernel work per step), so that a tiny batch_size is
not free. One work unit is a row through one coupling block; the default limit, 50,000,000
(REV88_MAX_TASK_WORK), admits 60,000 train rows x 10,000 queries x 100 epochs at depth 4
(30,043,200 units) and refuses 10,000 rows x 100,000 epochs (about 2.5e9).

    bytes = the peak memory the largest backend (cpu, torch) needs for the task, beyond the
            process itself: the task's arrays (float32 images, int64 labels), the lifted
            features, parameter-sized arrays (initial, parameters, velocity, gradients and
            their copies), the epoch permutations (int64, epochs x N: prepare() materializes
            the whole list, cpu-fast and cuda stack a second copy), one minibatch's
            activations (batch x 82 x (2 depth + 2) floats, times a factor) and the queries'
            scores, predictions and forward temporaries.

The default limit is 1 GiB (REV88_MAX_TASK_BYTES). ``check_budget`` checks work first
(over its limit: ``learner.errors.BudgetExceeded`` with status 422), then memory (413).

How the estimate compares with measured peaks, backend by backend (the smallest margin is the
permutation term on cpu-fast): docs/performance.md, "Memory: the budget's estimate".
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from .config import Config
from .errors import BudgetExceeded, ConfigError
from .shape import CLASSES, FEATURES, parameter_count

DEFAULT_MAX_TASK_WORK = 50_000_000
DEFAULT_MAX_TASK_BYTES = 1 << 30
WORK_ENV, BYTES_ENV = "REV88_MAX_TASK_WORK", "REV88_MAX_TASK_BYTES"

STEP_ROWS = 32  # fixed overhead of one minibatch step, in rows
PIXELS = 81
F32, I64 = 4, 8
# copies of each kind of array alive at the peak, from the code (cpu backend unless said):
TASK_COPIES = 2  # the arrays, and hashing's transient bytes copy of one of them
LIFT_COPIES = 2  # lift(): the (N, 82) result while 4x - 0.5 is still alive
PARAM_COPIES = 8  # initial (numpy + torch), parameters, velocity, gradients, results, state vector
PERM_COPIES = 2  # the list from prepare(); cpu-fast and cuda stack a second copy
ACT_COPIES = 3  # per branch and row: activation and gradient (cpu-fast keeps both for every branch)
QUERY_COPIES = 8  # scoring all queries at once: lifted queries, the state, a branch's temporaries, hashing


@dataclasses.dataclass(frozen=True)
class Estimate:
    work: int  # rows x blocks, see the module docstring
    bytes: int  # peak memory, an upper estimate
    steps: int  # minibatch steps: steps_per_epoch x epochs

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def estimate(train_count: int, test_count: int, config: Config) -> Estimate:
    """Work and peak memory of training on ``train_count`` rows and scoring ``test_count``
    queries with ``config`` (only depth, epochs and batch_size matter)."""
    n, m = int(train_count), int(test_count)
    depth, epochs, batch_size = config.depth, config.epochs, config.batch_size
    steps_per_epoch = -(-n // batch_size)
    work = depth * (epochs * (n + STEP_ROWS * steps_per_epoch) + m)
    batch = min(batch_size, n)
    nbytes = (
        TASK_COPIES * (n * (PIXELS * F32 + I64) + m * PIXELS * F32)
        + LIFT_COPIES * (n + m) * FEATURES * F32
        + PARAM_COPIES * parameter_count(depth) * F32
        + PERM_COPIES * epochs * n * I64
        + ACT_COPIES * batch * FEATURES * (2 * depth + 2) * F32
        + m * (2 * CLASSES * F32 + I64 + QUERY_COPIES * FEATURES * F32)
    )
    return Estimate(work=work, bytes=nbytes, steps=steps_per_epoch * epochs)


def check_budget(
    est: Estimate, max_work: int = DEFAULT_MAX_TASK_WORK, max_bytes: int = DEFAULT_MAX_TASK_BYTES
) -> None:
    """Raise BudgetExceeded when the estimate is over a limit: work first (422), then memory (413)."""
    if est.work > max_work:
        raise BudgetExceeded(
            f"task needs an estimated {est.work:,} work units (depth × (epochs × (train rows + "
            f"{STEP_ROWS} × minibatches) + queries)), over the limit of {max_work:,} ({WORK_ENV})",
            status=422, resource="work", limit=max_work, estimate=est.work, env=WORK_ENV,
        )
    if est.bytes > max_bytes:
        raise BudgetExceeded(
            f"task needs an estimated {est.bytes:,} bytes of memory ({_gib(est.bytes)}: task arrays, lifted "
            "features, parameters, epoch permutations (epochs x train rows), minibatch activations "
            f"(batch x depth), query scores), over the limit of {max_bytes:,} bytes ({BYTES_ENV})",
            status=413, resource="bytes", limit=max_bytes, estimate=est.bytes, env=BYTES_ENV,
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 28 else f"{nbytes / (1 << 20):.1f} MiB"


def limits_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(max_work, max_bytes) from REV88_MAX_TASK_WORK and REV88_MAX_TASK_BYTES (defaults when
    unset or empty); a value that is not a positive integer is a ConfigError naming the variable."""
    environ = os.environ if environ is None else environ
    return (
        _positive_int(environ, WORK_ENV, DEFAULT_MAX_TASK_WORK, "work units"),
        _positive_int(environ, BYTES_ENV, DEFAULT_MAX_TASK_BYTES, "bytes"),
    )


def _positive_int(environ: Mapping[str, str], name: str, default: int, unit: str) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    value = int(text) if re.fullmatch(r"[0-9]{1,30}", text) else None
    if value is None or value < 1:
        raise ConfigError(f"{name} must be a positive integer ({unit}), got {text!r}", variable=name)
    return value
