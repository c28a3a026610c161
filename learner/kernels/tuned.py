"""The GPU backends' choices per GPU model, measured by scripts/gpu_tune.py: the one table they read.

    choice_for(gpu_name)   -> Tuned: the row for that GPU (``torch.cuda.get_device_name``), or
                              the table's default for a GPU nobody has tuned on

A row holds, for the ``fused`` backend:

    launch  (chunk, num_warps, precision) of the one-program-per-task kernel (fused_train.py), for
            launches of several tasks -- and for a lone task unless ``lone`` says otherwise
    lone    the choice for a launch of one task: the same keys plus ``variant`` ("one": that
            kernel; "split": fused_rows.py and fused_update.py, each step over several programs)
            -- or None: as ``launch``

and for the ``cuda`` backend its ``cuda_step`` ("autograd": train.train_step, as the cpu backend;
"explicit" and "explicit-bmm": learner/backends/cuda.py's ``ExplicitStep``, the reversible backward
written out with fewer kernels per step, its weight gradients by ``mm`` or by ``bmm``).

``chunk`` is the largest number of rows per pass: a minibatch smaller than it runs in the smallest
power of two >= 16 that holds it. ``precision`` is ``tl.dot``'s input precision: "ieee" (fp32
FMAs) or "tf32x3" (three TF32 tensor-core products). A request may ask for "ieee" whatever the
table says (``?precision=ieee``); the answer's metadata says which ran.

How a row gets here: ``scripts/gpu_tune.py`` on that GPU times every candidate -- alone and in a
launch of the SM count -- and checks each on all eleven published draws against the cpu backend,
query by query (110,000 predictions equal; parameters and velocity within (2e-5, 3e-3) on draw 0).
A candidate that changes one prediction is reported and never chosen. ``--write`` replaces the
block between the BEGIN and END lines below with the winners (and nothing else in this file).

Until a GPU has run it, the H200's row is the best one the first GPU run measured by hand
(../shared/notes/gpu-h200.md, 2026-12-04: chunk 128, 8 warps, ieee: 24.1 ms for a lone draw-0
task, 0.208 ms per task in a launch of 132, the eleven draws 98,208 with every draw's count the
published one). That kernel summed the softmax's denominator and the bias's gradient with
``tl.sum``; today's sums them in one fixed order (learner/kernels/fused_parts.py), so its eleven
draws are the tuning run's to check again. tf32x3 (17.5 ms / 0.161 ms there, its predictions not
compared query by query), the split variant and the explicit cuda step are candidates for the
tuning run, not choices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PRECISIONS = ("ieee", "tf32x3")  # the same as learner.kernels.fused_parts.PRECISIONS (no triton import here)
VARIANTS = ("one", "split")
CUDA_STEPS = ("autograd", "explicit", "explicit-bmm")  # = learner.backends.cuda.STEPS

# cuBLAS's workspace for the cuda backend, set by ``import learner`` when CUBLAS_WORKSPACE_CONFIG is
# unset (it must be set before CUDA starts, so it is one value for the process, not per GPU). The
# seed's ":16:8" (8 buffers of 16 KiB: 128 KiB per stream), the one whose replays the first GPU run
# compared with the cpu backend (2026-12-04, an H200: draw 0, 0 of 10,000 predictions differ;
# 59.9 ms per task). ":4096:8" (8 x 4 MiB, 32 MiB per stream) replayed a task in 44.1 ms there, but
# its predictions have not been compared with the cpu backend's query by query on a GPU: cuBLAS picks
# other kernels (split-K reductions) with more workspace, so its sums may round differently.
# scripts/gpu_tune.py runs the cuda backend with the other workspace in a child process on the eleven
# draws against the cpu backend, query by query, and writes ":4096:8" here (--write, and its
# tuned.py) only when it passed that check and was faster. Both are the settings NVIDIA documents
# for repeatable results.
CUBLAS_WORKSPACE = ":16:8"

# BEGIN TABLE (scripts/gpu_tune.py --write replaces this block)
DEFAULT: dict[str, Any] = {
    "launch": {"chunk": 128, "num_warps": 8, "precision": "ieee"},
    "lone": None,
    "cuda_step": "autograd",
    "source": (
        "no GPU has tuned this row: the H200's hand-measured best (../shared/notes/gpu-h200.md)"
    ),
}
TABLE: dict[str, dict[str, Any]] = {
    "NVIDIA H200": {
        "launch": {"chunk": 128, "num_warps": 8, "precision": "ieee"},
        "lone": None,
        "cuda_step": "autograd",
        "source": (
            "measured by hand on 2026-12-04 (bench/bench_fused.py --sweep, "
            "../shared/notes/gpu-h200.md); not yet by scripts/gpu_tune.py"
        ),
    },
}
# END TABLE


@dataclasses.dataclass(frozen=True)
class Choice:
    chunk: int
    num_warps: int
    precision: str
    variant: str = "one"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Tuned:
    gpu: str | None  # the name looked up
    row: str  # the table's key that answered, or "default"
    launch: Choice
    lone: Choice
    cuda_step: str
    source: str

    def for_launch(self, tasks: int) -> Choice:
        return self.lone if tasks == 1 else self.launch

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "row": self.row, "launch": self.launch.as_dict(), "lone": self.lone.as_dict(),
                "cuda_step": self.cuda_step, "source": self.source}


def check_choice(raw: dict[str, Any], where: str) -> Choice:
    """A table entry -> Choice; a clear error naming the entry when a value is not one the kernels have."""
    choice = Choice(chunk=raw["chunk"], num_warps=raw["num_warps"], precision=raw["precision"],
                    variant=raw.get("variant", "one"))
    if not isinstance(choice.chunk, int) or choice.chunk < 16 or choice.chunk > 256 or choice.chunk & (choice.chunk - 1):
        raise ValueError(f"{where}: chunk must be a power of two in [16, 256], got {choice.chunk!r}")
    if choice.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{where}: num_warps must be 1, 2, 4, 8 or 16, got {choice.num_warps!r}")
    if choice.precision not in PRECISIONS:
        raise ValueError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {choice.precision!r}")
    if choice.variant not in VARIANTS:
        raise ValueError(f"{where}: variant must be one of {', '.join(VARIANTS)}, got {choice.variant!r}")
    return choice


def row_from(raw: dict[str, Any], gpu: str | None, key: str) -> Tuned:
    launch = check_choice(raw["launch"], f"tuned table row {key!r}, launch")
    if launch.variant != "one":
        raise ValueError(f"tuned table row {key!r}: a launch of several tasks runs variant 'one', got {launch.variant!r}")
    lone = launch if raw.get("lone") is None else check_choice(raw["lone"], f"tuned table row {key!r}, lone")
    step = raw.get("cuda_step", "autograd")
    if step not in CUDA_STEPS:
        raise ValueError(f"tuned table row {key!r}: cuda_step must be one of {', '.join(CUDA_STEPS)}, got {step!r}")
    return Tuned(gpu=gpu, row=key, launch=launch, lone=lone, cuda_step=step, source=str(raw.get("source", "")))


def choice_for(gpu_name: str | None, table: dict[str, dict[str, Any]] | None = None,
               default: dict[str, Any] | None = None) -> Tuned:
    """The row for ``gpu_name`` (exact name, as torch.cuda.get_device_name gives it), else the default."""
    table = TABLE if table is None else table
    if gpu_name is not None and gpu_name in table:
        return row_from(table[gpu_name], gpu_name, gpu_name)
    return row_from(DEFAULT if default is None else default, gpu_name, "default")
