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


def _fused_record(name, digests, single_ms, launch_ms=None, launch_differing=0, single_digest=None,
                  launch_bytes=("p", "s"), launch_launch=("P", "S"), variant="one", precision="ieee"):
    """A fused candidate's result as gpu_tune.run_candidate reports it (the fields select reads)."""
    return {"name": name, "kind": "fused", "variant": variant, "precision": precision, "passed": True,
            "choice": {"chunk": 128, "num_warps": 8, "precision": precision, "variant": variant},
            "check": {"digests": digests, "passed": True,
                      "launch_bytes": {"predictions_sha256": launch_bytes[0], "scores_sha256": launch_bytes[1]}},
            "single": {"median_ms": single_ms, "digest": digests[0] if single_digest is None else single_digest},
            "launch": None if launch_ms is None else {
                "median_ms_per_task": launch_ms, "tasks_per_launch": 132,
                "check": {"predictions_differing": launch_differing, "predictions_sha256": launch_launch[0],
                          "scores_sha256": launch_launch[1]}}}


def test_a_launch_that_changed_a_prediction_is_never_the_launch_choice():
    """The SM-count launch's predictions are checked against the cpu backend's: a candidate whose
    launch changed one is not chosen, however fast, nor one whose task alone gives other bytes."""
    tune = _gpu_tune()
    results = [_fused_record("slow", ["a", "b"], 24.0, 0.20),
               _fused_record("fast but flips", ["a", "b"], 20.0, 0.10, launch_differing=1),
               _fused_record("fast but alone differs", ["a", "b"], 20.0, 0.11, single_digest="x")]
    choice = tune.select(results, "GPU X", "2026-12-05", ":16:8")
    assert choice["launch"] == "slow"
    assert "changed 1 predictions" in choice["not_eligible_for_the_launch"]["fast but flips"]
    assert "alone gives other bytes" in choice["not_eligible_for_the_launch"]["fast but alone differs"]
    only = tune.select(results[1:2], "GPU X", "2026-12-05", ":16:8")
    assert only["row"] is None and "changed no prediction" in only["why_no_row"]


def test_the_bytes_across_candidates_are_recorded_beside_the_row():
    """Which candidates give the launch choice's bytes (a task's answer whatever the table picks),
    which only other scores, which other predictions: in the choice and in the row written."""
    tune = _gpu_tune()
    results = [_fused_record("chosen", ["a", "b"], 24.0, 0.20),
               _fused_record("same", ["a", "b"], 30.0, 0.30),
               _fused_record("other scores", ["a", "c"], 30.0, 0.30, launch_bytes=("p", "s2")),
               _fused_record("other launch scores", ["a", "b"], 30.0, 0.30, launch_launch=("P", "S2")),
               _fused_record("other predictions", ["a", "d"], 30.0, 0.30, launch_bytes=("p2", "s3")),
               _fused_record("split", ["a", "b"], 9.0, variant="split")]
    choice = tune.select(results, "GPU X", "2026-12-05", ":16:8")
    assert choice["launch"] == "chosen" and choice["lone"] == "split"
    b = choice["bytes"]
    assert b["same"] == ["same", "split"] and b["other_predictions"] == ["other predictions"]
    assert b["other_scores"] == ["other scores", "other launch scores"]
    assert choice["row"]["bytes"] == {"same": ["same", "split"], "other_scores": ["other scores", "other launch scores"],
                                      "other_predictions": ["other predictions"]}
    text = tune.with_row(_tuned_text(), "GPU X", choice["row"])
    scope: dict = {}
    exec(compile(text, "tuned.py", "exec"), scope)
    assert scope["TABLE"]["GPU X"]["bytes"]["other_predictions"] == ["other predictions"]
    assert tuned.row_from(scope["TABLE"]["GPU X"], "GPU X", "GPU X").lone == tuned.Choice(128, 8, "ieee", "split")


def _tuned_text() -> str:
    from pathlib import Path

    return Path(tuned.__file__).read_text()


def _cuda_record(name, step, ms, passed=True, workspace=None):
    return {"name": name, "kind": "cuda", "variant": "one", "precision": "ieee", "step": step, "passed": passed,
            "workspace": workspace, "single": {"median_ms": ms}, "check": {"passed": passed},
            "refused": None if passed else "3 of 110000 predictions differ from the cpu backend's"}


@pytest.mark.parametrize("other, steps, switched, why", [
    (_cuda_record("cuda autograd :4096:8", "autograd", 44.1, workspace=":4096:8"),
     [("autograd", 59.9), ("explicit", 70.0)], True, "passed the eleven draws query by query"),
    (_cuda_record("cuda autograd :4096:8", "autograd", 44.1, passed=False, workspace=":4096:8"),
     [("autograd", 59.9)], False, "was refused"),
    (_cuda_record("cuda autograd :4096:8", "autograd", 61.0, workspace=":4096:8"),
     [("autograd", 59.9)], False, "is not faster"),
    (_cuda_record("cuda autograd :4096:8", "autograd", 44.1, workspace=":4096:8"),
     [("autograd", 59.9), ("explicit", 50.0)], False, "was not run with :4096:8"),
])
def test_the_workspace_switches_only_after_its_query_by_query_pass(other, steps, switched, why):
    tune = _gpu_tune()
    results = [_fused_record("one", ["a"], 24.0, 0.2)] + [_cuda_record(f"cuda {s}", s, ms) for s, ms in steps] + [other]
    choice = tune.select(results, "GPU X", "2026-12-05", ":16:8")
    assert choice["cublas_workspace_switched"] is switched and why in choice["cublas_workspace_why"]
    assert choice["cublas_workspace"] == (":4096:8" if switched else ":16:8")
    text = tune.with_row(_tuned_text(), "GPU X", choice["row"],
                         workspace=choice["cublas_workspace"] if switched else None)
    assert (f'CUBLAS_WORKSPACE = "{":4096:8" if switched else tuned.CUBLAS_WORKSPACE}"' in text)


def test_the_seeds_workspace_is_the_default_until_a_gpu_compared_the_other():
    """learner/__init__.py's default is the tuned table's, and that is the seed's :16:8 (issue #53)."""
    assert tuned.CUBLAS_WORKSPACE == ":16:8"
    tune = _gpu_tune()
    assert tune.ALT_WORKSPACE == ":4096:8"


def test_tune_json_is_replaced_after_every_candidate_and_a_candidate_has_its_own_limit(tmp_path, monkeypatch):
    """The tuning run on the CPU (cuda steps, eagerly on the dry run's slices): tune.json is
    replaced whole after every candidate (what a call ended by its time limit brings back), and a
    candidate that runs past its own limit is refused, saying so, while the next one runs."""
    import json
    import sys
    import time

    from learner.backends.cpu import CpuBackend
    from learner.config import Config
    from learner.data import bundled_mnist_dir
    from learner.train import prepare

    tune = _gpu_tune()
    common = sys.modules["gpu_check_common"]
    cands = [tune.Candidate("cuda", step="autograd"), tune.Candidate("cuda", step="explicit"),
             tune.Candidate("cuda", step="explicit-bmm"), tune.Candidate("cuda", step="autograd", workspace=":4096:8")]
    other_steps = []

    def other_workspace(c, *args):  # the child process, stood in for: which step it was given
        other_steps.append(c.step)
        return {**tune._refused_entry(c, "a stand-in"), "passed": False}

    monkeypatch.setattr(tune, "other_workspace", other_workspace)
    monkeypatch.setattr(tune, "candidates", lambda: cands)

    class Reference:  # the cpu backend on the dry run's slices, in this process
        path = None

        def __init__(self, tasks):
            outs = [CpuBackend().run(t, prepare(t, Config())) for t in tasks]
            self.doc = {"predictions": [o.scores.argmax(1) for o in outs], "params0": outs[0].final_parameters,
                        "velocity0": outs[0].final_velocity, "correct": [0] * len(tasks),
                        "seconds_per_draw": [0.0] * len(tasks), "threads": 1, "wall_seconds": 0.0,
                        "source": "this test", "task_digests": [], "launch_digests": [], "launch_predictions": []}

        def result(self, timeout=None):
            return self.doc

    monkeypatch.setattr(tune, "shared_reference", lambda mnist, dry, out, tasks=None, log=None: Reference(tasks))
    slow_run_draws = tune.run_draws

    def run_draws(engine, tasks, prepareds):
        if getattr(engine, "step", None) == "explicit":
            time.sleep(30)  # past its limit
        return slow_run_draws(engine, tasks, prepareds)

    monkeypatch.setattr(tune, "run_draws", run_draws)
    limits = {"autograd": 60.0, "explicit": 1.0, "explicit-bmm": 60.0}
    monkeypatch.setattr(tune, "cost_of", lambda c: tune.gpu_budget.Cost(0.0, limits[c.step], "a test"))
    monkeypatch.setattr(tune, "choose_workspace", lambda results, cuda, workspace: {
        "cublas_workspace": workspace, "cublas_workspace_switched": False, "cublas_workspace_why": "a test"})
    seen = []

    def checkpoint():
        doc = json.loads((tmp_path / "tune" / "tune.json").read_text())
        seen.append(len(doc.get("candidates") or []))

    alarms = common.Alarms()
    assert alarms.arm(600)
    t = time.monotonic()
    try:
        report = tune.run(tmp_path / "tune", bundled_mnist_dir(), True, 600, write=False, sm90=False,
                          log=lambda *a: None, alarms=alarms, checkpoint=checkpoint)
    finally:
        alarms.quiet()
        alarms.disarm()
    assert time.monotonic() - t < 25
    assert [n for n in seen if n] == [1, 2, 3, 4, 4], seen  # after each candidate, and the final report
    by = {r["step"]: r for r in report["candidates"] if not r.get("workspace")}
    # the other workspace ran with the fastest step that passed here (explicit was refused)
    fastest = min((by["autograd"], by["explicit-bmm"]), key=lambda r: r["single"]["median_ms"])["step"]
    assert other_steps == [fastest]
    assert by["autograd"]["passed"] and by["explicit-bmm"]["passed"]
    assert not by["explicit"]["passed"] and "ran past its own limit of 1 s" in by["explicit"]["refused"]
    on_disk = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [c["step"] for c in on_disk["candidates"]] == ["autograd", "explicit", "explicit-bmm", fastest]
    assert (tmp_path / "tune" / "summary.txt").exists() and not list((tmp_path / "tune").glob(".*.part"))
