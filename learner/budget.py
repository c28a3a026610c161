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

Measured (2-core x86-64 dev machine, torch 2.13 CPU, numpy 2.4): the peak RSS of one
``run_task`` above the process's RSS just before it (VmHWM reset with /proc/self/clear_refs;
the task's arrays already existed, so they are not in the peak), against the estimate:

    backend   train N  queries M  depth  epochs  batch  peak extra  + task arrays  estimate
    cpu        10,000     10,000      2       2    128     20.7 MB        27.3 MB    54.7 MB  (2.00x)
    cpu-fast   10,000     10,000      2       2    128      4.0 MB        10.6 MB    54.7 MB  (5.16x)
    cpu            64         64     64     100    128      1.2 MB         1.2 MB    15.5 MB  (12.7x)
    cpu-fast       64         64     64     100    128      9.1 MB         9.2 MB    15.5 MB  (1.70x)
    cpu        10,000      1,000      2     300  65536     90.6 MB        94.3 MB   124.5 MB  (1.32x)
    cpu-fast   10,000      1,000      2    1000  65536    180.3 MB       184.0 MB   236.5 MB  (1.29x)
    cpu        65,536        100      1       2  65536    227.7 MB       249.5 MB   347.1 MB  (1.39x)
    cpu-fast   65,536        100      1       2  65536     83.3 MB       105.1 MB   347.1 MB  (3.30x)
    cpu         8,192        100     16       2   8192     68.2 MB        71.0 MB   287.3 MB  (4.05x)
    cpu-fast    8,192        100     16       2   8192    108.2 MB       110.9 MB   287.3 MB  (2.59x)
    cpu        60,000     10,000      4       3    128     41.0 MB        64.2 MB   124.0 MB  (1.93x)
    cpu-fast   60,000     10,000      4     100    128     96.6 MB       119.8 MB   217.1 MB  (1.81x)
    cpu         1,000    200,000      8       1    128    460.4 MB       525.5 MB   807.7 MB  (1.54x)
    cpu-fast    1,000    200,000      8       1    128     76.3 MB       141.4 MB   807.7 MB  (5.71x)

(random pixels and labels, learning_rate 0.01; MB = 10^6 bytes; the ratio is the estimate over
peak extra + task arrays). What the rows show: the permutation term (epochs x N x 8 bytes,
twice on cpu-fast: 1000 epochs x 10,000 rows is 80 MB per copy); the per-minibatch term
(torch keeps ~10 batch x 82 float32 arrays at depth 1, cpu-fast a gradient and an
activation per branch and row, hence the depth factor); the queries, scored all at once on
cpu (~7 query x 82 float32 arrays, with the allocator's retention). The smallest margin,
1.29x, is the permutation term on cpu-fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from .config import Config
from .errors import BudgetExceeded, ConfigError
from .model import CLASSES, FEATURES
from .train import parameter_count

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
