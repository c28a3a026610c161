"""The GPU backends' tuned table (learner/kernels/tuned.py) and how they read it; the tuning run's
choice (scripts/gpu_tune.py): a candidate that changes one prediction is refused; the table it
writes reads back. The timing itself needs a GPU; ``gpu_tune.py --dry-run`` (also run here, on
small tasks in Triton's interpreter) rehearses everything else."""

from __future__ import annotations

import pytest

from learner.kernels import tuned


def test_known_gpu_gets_its_row_and_an_unknown_one_the_default():
    h200 = tuned.choice_for("NVIDIA H200")
    assert h200.row == "NVIDIA H200"
    assert (h200.launch.chunk, h200.launch.num_warps, h200.launch.precision) == (128, 8, "ieee")
    assert h200.lone == h200.launch  # no lone row measured yet: the launch's choice
    other = tuned.choice_for("NVIDIA Imaginary 9000")
    assert other.row == "default" and other.gpu == "NVIDIA Imaginary 9000"
    assert other.launch == tuned.row_from(tuned.DEFAULT, None, "default").launch
    assert tuned.choice_for(None).row == "default"  # the interpreter, or no GPU name
    assert tuned.choice_for("NVIDIA H200 NVL").row == "default"  # exact names only: another board


def test_a_row_with_a_lone_choice():
    table = {"GPU X": {"launch": {"chunk": 64, "num_warps": 4, "precision": "tf32x3"},
                       "lone": {"chunk": 16, "num_warps": 4, "precision": "tf32x3", "variant": "split"},
                       "cuda_step": "explicit", "source": "a test"}}
    row = tuned.choice_for("GPU X", table)
    assert row.for_launch(1) == tuned.Choice(16, 4, "tf32x3", "split")
    assert row.for_launch(2) == row.launch == tuned.Choice(64, 4, "tf32x3", "one")
    assert row.cuda_step == "explicit" and row.as_dict()["lone"]["variant"] == "split"


@pytest.mark.parametrize("bad, message", [
    ({"chunk": 48, "num_warps": 8, "precision": "ieee"}, "chunk must be a power of two"),
    ({"chunk": 64, "num_warps": 3, "precision": "ieee"}, "num_warps must be"),
    ({"chunk": 64, "num_warps": 8, "precision": "tf32"}, "precision must be one of ieee, tf32x3"),
    ({"chunk": 64, "num_warps": 8, "precision": "ieee", "variant": "two"}, "variant must be one of"),
])
def test_a_bad_table_entry_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message) as info:
        tuned.choice_for("GPU X", {"GPU X": {"launch": bad}})
    assert "'GPU X'" in str(info.value)


def test_a_launch_of_several_tasks_runs_the_one_program_kernel():
    with pytest.raises(ValueError, match="runs variant 'one'"):
        tuned.choice_for("GPU X", {"GPU X": {"launch": {"chunk": 64, "num_warps": 8, "precision": "ieee",
                                                        "variant": "split"}}})


def test_fused_backend_reads_the_table():
    """What a launch runs (learner.backends.fused.choose, FusedBackend.choice's rule): the tuned
    row's choice (lone or launch), its chunk the largest (a small minibatch gets a smaller power of
    two), and the backend's fixed values or the request's precision first."""
    from learner.backends.fused import SPLIT_MAX_BATCH, choose
    from learner.config import make_config

    row = tuned.choice_for("GPU X", {"GPU X": {
        "launch": {"chunk": 128, "num_warps": 8, "precision": "tf32x3"},
        "lone": {"chunk": 32, "num_warps": 4, "precision": "tf32x3", "variant": "split"}}})
    default = make_config({})
    assert choose(row, default, 132) == tuned.Choice(128, 8, "tf32x3", "one")
    assert choose(row, default, 1) == tuned.Choice(32, 4, "tf32x3", "split")
    assert choose(row, default, 132, precision="ieee").precision == "ieee"  # ?precision=ieee
    assert choose(row, make_config({"batch_size": 20}), 2) == tuned.Choice(32, 4, "tf32x3", "one")
    big = make_config({"batch_size": SPLIT_MAX_BATCH + 1})  # the split variant's slices would not fit
    assert choose(row, big, 1).variant == "one"
    fixed = dict(chunk=64, num_warps=2, precision="ieee", variant="one")
    assert choose(row, default, 1, **fixed) == tuned.Choice(64, 2, "ieee", "one")
    h200 = tuned.choice_for("NVIDIA H200")
    assert choose(h200, default, 1) == choose(h200, default, 132) == tuned.Choice(128, 8, "ieee", "one")


def test_split_limit_is_the_kernels():
    pytest.importorskip("triton")
    from learner.backends.fused import SPLIT_MAX_BATCH
    from learner.kernels.fused_step import SPLIT_MAX_BATCH as KERNEL_LIMIT

    assert SPLIT_MAX_BATCH == KERNEL_LIMIT


def test_precision_view_runs_every_task_at_its_precision():
    """A request's ?precision=: the view the device worker hands run_task and run_many."""
    from learner.backends.fused import PrecisionView

    class Backend:
        name, device = "fused", "cuda:0"
        calls: list = []

        def describe(self):
            return {"backend": "fused", "precision": "tf32x3"}

        def run(self, task, prepared, precision=None):
            self.calls.append(("run", precision))

        def run_many(self, tasks, prepareds, precision=None):
            self.calls.append(("run_many", precision))

    view = PrecisionView(Backend(), "ieee")
    view.run(None, None)
    view.run_many([], [])
    assert Backend.calls == [("run", "ieee"), ("run_many", "ieee")]
    assert (view.name, view.device, view.describe()["precision"]) == ("fused", "cuda:0", "ieee")
