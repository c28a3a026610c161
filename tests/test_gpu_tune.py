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
    from learner.kernels.fused_rows import SPLIT_MAX_BATCH as KERNEL_LIMIT

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


# --------------------------------------------------------------------------- scripts/gpu_tune.py


def _gpu_tune():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_tune.py"
    if "gpu_tune_under_test" not in sys.modules:  # (a dataclass needs its module registered)
        spec = importlib.util.spec_from_file_location("gpu_tune_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_tune_under_test"]


def _slices(draw0, count=3):
    from learner.taskio import validate_task

    full = draw0[0]
    return [validate_task(full.train_images[s:s + 120].copy(), full.train_labels[s:s + 120].copy(),
                          full.test_images[s:s + 30].copy()) for s in range(0, 200 * count, 200)]


def test_a_candidate_that_changes_one_prediction_is_refused_and_never_chosen(draw0):
    """A deliberately wrong candidate -- the cpu backend with one query's top two scores swapped --
    is checked by the tuning run's own code against the cpu reference: refused with the one
    prediction it changed, and not chosen although it is the fastest."""
    import numpy as np

    from learner.backends.cpu import CpuBackend
    from learner.config import make_config
    from learner.train import prepare

    tune = _gpu_tune()
    tasks = _slices(draw0)
    config = make_config({"batch_size": 32})
    prepareds = [prepare(t, config) for t in tasks]
    cpu = CpuBackend()
    ref_outs = [cpu.run(t, p) for t, p in zip(tasks, prepareds)]
    ref = {"predictions": [o.scores.argmax(1) for o in ref_outs], "params0": ref_outs[0].final_parameters,
           "velocity0": ref_outs[0].final_velocity}

    class OnePredictionChanged:
        name, device = "fused", "cpu"

        def run(self, task, prepared):
            out = cpu.run(task, prepared)
            if task is tasks[1]:  # query 3 of draw 1: its two best classes swapped
                row = out.scores[3]
                top, second = np.argsort(row)[::-1][:2]
                row[top], row[second] = row[second], row[top]
            return out

    good = tune.check_outputs(tune.run_draws(cpu, tasks, prepareds), ref)
    wrong = tune.check_outputs(tune.run_draws(OnePredictionChanged(), tasks, prepareds), ref)
    assert good["passed"] and good["predictions_differing"] == 0
    assert not wrong["passed"]
    assert wrong["predictions_differing"] == 1 and wrong["differing_by_draw"] == [0, 1, 0]
    assert wrong["differing_queries"] == {"1": [3]}
    assert "1 of 90 predictions differ" in wrong["refused"]

    def record(name, check, single_ms, launch_ms):
        return {"name": name, "kind": "fused", "variant": "one", "precision": "ieee", "passed": check["passed"],
                "refused": check.get("refused"), "check": check,
                "choice": {"chunk": 128, "num_warps": 8, "precision": "ieee", "variant": "one"},
                "single": {"median_ms": single_ms}, "launch": {"median_ms_per_task": launch_ms, "tasks_per_launch": 132}}

    results = [record("fused one 128x8 ieee", good, 24.1, 0.208), record("fused one 64x4 tf32", wrong, 9.0, 0.05)]
    choice = tune.select(results, "GPU X", "2026-12-05")
    assert choice["launch"] == choice["lone"] == "fused one 128x8 ieee"
    assert "1 of 90 predictions differ" in choice["refused"]["fused one 64x4 tf32"]
    assert choice["row"]["launch"] == {"chunk": 128, "num_warps": 8, "precision": "ieee"} and choice["row"]["lone"] is None
    # nothing passes: no row, and the reason
    none = tune.select([record("fused one 64x4 tf32", wrong, 9.0, 0.05)], "GPU X", "2026-12-05")
    assert none["row"] is None and "no one-program fused candidate passed" in none["why_no_row"]


def test_the_lone_choice_must_give_the_launch_choice_bytes():
    """A faster lone candidate whose bytes differ from the launch choice's is not the lone choice
    (a task's answer must not depend on whether it shared a launch)."""
    tune = _gpu_tune()

    def record(name, variant, digests, single_ms, launch_ms=None, precision="ieee"):
        return {"name": name, "kind": "fused", "variant": variant, "precision": precision, "passed": True,
                "check": {"digests": digests, "passed": True},
                "choice": {"chunk": 32, "num_warps": 4, "precision": precision, "variant": variant},
                "single": {"median_ms": single_ms},
                "launch": None if launch_ms is None else {"median_ms_per_task": launch_ms, "tasks_per_launch": 132}}

    results = [record("one", "one", ["a", "b"], 24.0, 0.2), record("split same", "split", ["a", "b"], 9.0),
               record("split other", "split", ["a", "c"], 5.0),
               record("split tf32x3", "split", ["a", "b"], 4.0, precision="tf32x3")]
    choice = tune.select(results, "GPU X", "2026-12-05")
    assert (choice["launch"], choice["lone"]) == ("one", "split same")
    assert choice["faster_alone_but_not_the_launch_choice_bytes"] == ["split other"]
    assert choice["row"]["lone"]["variant"] == "split"


def test_the_table_written_reads_back():
    """--write replaces only the block between BEGIN and END; the new row is what choice_for reads."""
    from pathlib import Path

    tune = _gpu_tune()
    path = Path(tuned.__file__)
    text = path.read_text()
    row = {"launch": {"chunk": 64, "num_warps": 4, "precision": "tf32x3"},
           "lone": {"chunk": 16, "num_warps": 4, "precision": "tf32x3", "variant": "split"},
           "cuda_step": "explicit", "source": "scripts/gpu_tune.py on GPU Y, a test"}
    new = tune.with_row(text, "GPU Y", row)
    before, after = text.split(tune.BEGIN)[0], text.split(tune.END)[1]
    assert new.startswith(before) and new.endswith(after)
    scope: dict = {}
    exec(compile(new, "tuned.py", "exec"), scope)
    assert scope["TABLE"]["GPU Y"] == row and scope["TABLE"]["NVIDIA H200"] == tuned.TABLE["NVIDIA H200"]
    assert scope["DEFAULT"] == tuned.DEFAULT
    got = tuned.choice_for("GPU Y", scope["TABLE"], scope["DEFAULT"])
    assert got.lone == tuned.Choice(16, 4, "tf32x3", "split") and got.cuda_step == "explicit"
    block = new[new.index(tune.BEGIN):new.index(tune.END)]
    assert all(len(line) <= 110 for line in block.splitlines())  # the repository's line length


def test_every_candidate_is_a_valid_choice_and_the_run_fits_six_minutes():
    tune = _gpu_tune()
    cands = tune.candidates()
    for c in cands:
        if c.kind == "fused":
            tuned.check_choice(c.choice(), c.name)
    names = [c.name for c in cands]
    assert len(names) == len(set(names))
    assert {c.precision for c in cands if c.kind == "fused"} == set(tuned.PRECISIONS)
    assert {c.variant for c in cands if c.kind == "fused"} == set(tuned.VARIANTS)
    estimate = tune.estimate_device_s(cands)
    assert estimate["fits"] and estimate["total_s"] <= 360
