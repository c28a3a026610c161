"""rev88 evaluate: draw syntax, exact band arithmetic, the SD, the chart, and real
runs (draw 0 in process; draws 0 and 1 through a real server, equal to in process)."""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ET
from fractions import Fraction

import httpx
import numpy as np
import pytest

from learner.config import Config
from learner.evaluate import bands_met, evaluate, sample_sd_pp, totals
from learner.hashing import array_sha256
from learner.report_plot import Frame, accuracy_svg, spread_labels, y_range
from learner.taskio import ALLOWED_MEMBERS, TaskArrays, read_npz
from rev88.cli import main
from rev88.cli.common import CliError
from rev88.cli.evaluate import ServerEvaluation, ServiceRunner, parse_draws
from rev88.client import retry_after_seconds

from .conftest import small_task
from .server import running_server

DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
SVG = "{http://www.w3.org/2000/svg}"


# --------------------------------------------------------------------------- draws


@pytest.mark.parametrize(
    ("text", "draws"),
    [("0-10", list(range(11))), ("0,3,5", [0, 3, 5]), ("2", [2]), (" 7 , 0-2 ", [0, 1, 2, 7]), ("4-4", [4])],
)
def test_parse_draws(text, draws):
    assert parse_draws(text) == draws


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("0,,2", "empty item"),
        ("5-2", "backwards"),
        ("a", "'a' is not a draw number"),
        ("-1", "not a draw number"),
        ("1-", "not a draw number"),
        ("1-2-3", "not a draw number"),
        ("0,1,1", "draw 1 more than once"),
        ("0-3,2", "draw 2 more than once"),
        ("11", "outside the published draws 0..10"),
        ("9-12", "11, 12 outside"),
    ],
)
def test_parse_draws_errors_say_what_is_wrong(text, words):
    with pytest.raises(CliError, match=words):
        parse_draws(text)


# --------------------------------------------------------------------------- figures


def test_bands_exact_at_the_boundary():
    # A mean error of exactly 5 % meets the 5 % band; a float 1 - 0.95 would not.
    assert 1 - 0.95 > 0.05
    t = totals([9500] * 11, [10000] * 11)
    assert t["mean_error_exact"] == "1/20"
    assert [b["met"] for b in t["error_bands"]] == [False, False, True, True, True]
    # One query fewer in one draw: 5 % + 1/110000, not met although it prints as 5.00 %.
    t = totals([9500] * 10 + [9499], [10000] * 11)
    assert f"{t['mean_error_percent']:.2f}" == "5.00"
    assert [b["met"] for b in t["error_bands"]] == [False, False, False, True, True]


@pytest.mark.parametrize(
    ("error", "met"),
    [
        (Fraction(2, 100), [True] * 5),
        (Fraction(2, 100) + Fraction(1, 10**12), [False, True, True, True, True]),
        (Fraction(3, 100), [False, True, True, True, True]),
        (Fraction(12, 100), [False, False, False, False, True]),
        (Fraction(13205, 110000), [False] * 5),  # 12.0045 %: rounds to 12.00 %, still not met
        (Fraction(0), [True] * 5),
        (Fraction(1), [False] * 5),
    ],
)
def test_bands_met_unrounded(error, met):
    assert list(bands_met(error).values()) == met
    assert list(bands_met(error)) == [2, 3, 5, 8, 12]


def test_bands_met_refuses_floats():
    with pytest.raises(TypeError, match="exact"):
        bands_met(0.05)


def test_sample_sd_pp():
    assert sample_sd_pp([Fraction(88, 100)]) is None
    assert sample_sd_pp([Fraction(1, 2)] * 4) == 0.0
    # (88 %, 89 %): mean 88.5 %, deviations ±0.5 pp, variance 0.5/1 -> sqrt(0.5) pp.
    assert sample_sd_pp([Fraction(88, 100), Fraction(89, 100)]) == pytest.approx(0.5**0.5, rel=1e-15)
    counts = [8887, 8912, 8850, 8901, 8876, 8930, 8864, 8899, 8921, 8843, 8890]
    accs = [Fraction(c, 10000) for c in counts]
    expected = statistics.stdev([c / 100 for c in counts])  # percent, n - 1
    assert sample_sd_pp(accs) == pytest.approx(expected, rel=1e-12)
    # Shift invariance, exactly (fractions): adding 1 pp to every draw leaves the SD alone.
    assert sample_sd_pp([a + Fraction(1, 100) for a in accs]) == sample_sd_pp(accs)


def test_totals_pooled_and_mean():
    t = totals([8887, 8900], [10000, 10000])
    assert (t["correct"], t["total"], t["correct_over_total"]) == (17787, 20000, "17,787 / 20,000")
    assert t["pooled_accuracy"] == 17787 / 20000
    assert t["mean_accuracy"] == pytest.approx(0.88935, abs=1e-15)
    assert t["mean_error_exact"] == "2213/20000"
    assert t["sd_accuracy_pp"] == pytest.approx(statistics.stdev([88.87, 89.00]), rel=1e-12)


def test_retry_after_seconds():
    assert retry_after_seconds("3", 0) == 3.0
    assert retry_after_seconds(None, 0) == 1.0 and retry_after_seconds(None, 2) == 4.0
    assert retry_after_seconds("bogus", 1) == 2.0
    assert retry_after_seconds("100000", 0) == 120.0  # capped
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", 0) == 0.0  # a date in the past


# --------------------------------------------------------------------------- chart


def test_svg_marks_sit_at_their_values():
    draws, correct, total = [0, 1, 2], [8887, 8912, 8850], [10000] * 3
    mean = 100 * float(Fraction(sum(correct), 30000))
    sd = sample_sd_pp([Fraction(c, 10000) for c in correct])
    svg = accuracy_svg(draws, correct, total, mean, sd, met=[False, False, False, False, True])
    root = ET.fromstring(svg)  # well-formed XML
    lo, hi = y_range([88.87, 89.12, 88.50, 98, 97, 95, 92, 88, mean])
    frame = Frame(lo, hi, 3)
    assert (lo, hi) == (87.0, 99.0)
    points = root.findall(f"{SVG}circle[@class='draw']")
    assert [int(p.get("data-draw")) for p in points] == draws
    for i, (p, c) in enumerate(zip(points, correct)):
        assert float(p.get("cy")) == pytest.approx(frame.y(c / 100), abs=0.01)
        assert float(p.get("cx")) == pytest.approx(frame.x(i), abs=0.01)
    # Higher accuracy is higher on the page (smaller y).
    assert float(points[1].get("cy")) < float(points[0].get("cy")) < float(points[2].get("cy"))
    bands = root.findall(f"{SVG}line[@class='band']")
    assert [int(b.get("data-band")) for b in bands] == [2, 3, 5, 8, 12]
    for b in bands:
        assert float(b.get("y1")) == pytest.approx(frame.y(100 - int(b.get("data-band"))), abs=0.01)
    mean_line = root.find(f"{SVG}line[@id='mean']")
    assert float(mean_line.get("y1")) == pytest.approx(frame.y(mean), abs=0.01)
    sd_rect = root.find(f"{SVG}rect[@class='sd']")
    assert float(sd_rect.get("y")) == pytest.approx(frame.y(mean + sd), abs=0.01)
    assert float(sd_rect.get("height")) == pytest.approx(frame.y(mean - sd) - frame.y(mean + sd), abs=0.02)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "12 % band: 88 %: met" in texts and "2 % band: 98 %: not met" in texts


def test_spread_labels_keeps_gap_and_order():
    ys = [100.0, 104.0, 200.0, 205.0]
    out = spread_labels(ys, gap=13)
    assert out[0] == 100.0 and all(b - a >= 13 for a, b in zip(out, out[1:]))
    assert out[2] == 200.0


# --------------------------------------------------------------------------- the service client


def _small_answer(task: TaskArrays, config: Config, preds: np.ndarray) -> dict:
    return {
        "id": "t1",
        "predictions": preds.tolist(),
        "predictions_sha256": array_sha256(preds),
        "metadata": {
            "predictions_sha256": array_sha256(preds),
            "input_hashes": {n: array_sha256(a) for n, a in task.as_dict().items()},
            "config": config.as_dict(),
            "backend": "cpu",
            "training_prediction_seconds": 0.0,
        },
        "timing": {},
        "versions": {},
    }


def test_service_client_sends_three_arrays_retries_503_and_checks_hashes():
    # The HTTP transport is a stand-in here, to see exactly what the client sends and how it
    # treats 503; the real service is exercised in test_evaluate_two_draws_through_server.
    task, config = small_task(11, 5), Config().replace(batch_size=4)
    preds = np.arange(5, dtype=np.int64)
    seen, waits = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) < 3:
            return httpx.Response(503, headers={"Retry-After": "2"}, json={"error": "queue full"})
        return httpx.Response(200, json=_small_answer(task, config, preds))

    runner = ServiceRunner(
        "http://svc", config, "cpu", api_key="k", sleep=waits.append, transport=httpx.MockTransport(handler)
    )
    answer = runner(task)
    assert waits == [2.0, 2.0] and len(seen) == 3
    req = seen[-1]
    assert req.url.path == "/tasks" and req.headers["content-type"] == "application/octet-stream"
    assert req.headers["authorization"] == "Bearer k"
    assert dict(req.url.params) == {**{k: str(v) for k, v in config.as_dict().items()}, "backend": "cpu"}
    assert sorted(read_npz(req.content)) == sorted(ALLOWED_MEMBERS)  # nothing else, never labels
    assert np.array_equal(answer.predictions, preds)

    # A predictions list that does not match its hash is refused.
    bad = _small_answer(task, config, preds)
    bad["predictions"][0] = 4
    runner.transport = httpx.MockTransport(lambda r: httpx.Response(200, json=bad))
    with pytest.raises(CliError, match="do not hash"):
        runner(task)
    # Predictions that are not class numbers are refused, not truncated.
    bad = _small_answer(task, config, preds)
    bad["predictions"][0] = 1.5
    runner.transport = httpx.MockTransport(lambda r: httpx.Response(200, json=bad))
    with pytest.raises(CliError, match="not all class numbers"):
        runner(task)


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (401, "pass --api-key"),
        (422, r"rejected the task \(422\): config.depth"),
        (503, "stayed busy"),
        (500, r"failed \(500\)"),
    ],
)
def test_service_client_errors(status, words):
    task = small_task(11, 5)
    body = {"error": "config.depth must be > 0" if status == 422 else "nope"}
    runner = ServiceRunner(
        "http://svc",
        Config(),
        None,
        retries=1,
        sleep=lambda s: None,
        transport=httpx.MockTransport(lambda r: httpx.Response(status, json=body)),
    )
    with pytest.raises(CliError, match=words):
        runner(task)


def test_a_server_evaluations_errors_name_its_own_retries(tmp_path):
    """POST /evaluations answered 503 throughout: the message counts the retries this run asked for."""
    graded = ServerEvaluation("http://svc", Config(), None, retries=0,
                              transport=httpx.MockTransport(lambda r: httpx.Response(503, json={"error": "busy"})))
    with pytest.raises(CliError, match=r"stayed busy \(503\) after 0 retries: busy"):
        graded.run(tmp_path, [0], tmp_path / "out", None)


# --------------------------------------------------------------------------- command-line checks


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--draws", "0-11"], "11 outside the published draws"),
        (["--draws", "x"], "not a draw number"),
        (["--api-key", "k"], "--api-key only applies with --url"),
        (["--url", "localhost:8000"], "must start with http"),
        (["--retries", "-1"], "--retries must be >= 0"),
    ],
)
def test_cli_argument_errors(mnist_dir, tmp_path, capsys, extra, words):
    code = main(["evaluate", "--mnist-dir", str(mnist_dir), "--output", str(tmp_path / "r"), *extra])
    assert code == 2
    assert words in capsys.readouterr().err


def test_cli_missing_mnist_dir_and_nonempty_output(tmp_path, mnist_dir, capsys):
    assert main(["evaluate", "--mnist-dir", str(tmp_path / "nope"), "--output", str(tmp_path / "r")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["evaluate", "--mnist-dir", str(mnist_dir), "--output", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_runner_gets_only_the_task(mnist_dir, tmp_path):
    """The learner side sees a TaskArrays (three arrays) and never the query labels."""
    got = []

    def runner(task):
        from learner.evaluate import RunAnswer

        got.append(task)
        return RunAnswer(np.zeros(task.test_count, dtype=np.int64), {}, 0.0)

    records = evaluate(mnist_dir, [0], runner, tmp_path)
    (task,) = got
    assert isinstance(task, TaskArrays) and sorted(task.as_dict()) == sorted(ALLOWED_MEMBERS)
    # Predicting 0 everywhere scores the number of zeros among the held-back labels.
    labels_zeros = records[0]["correct"]
    assert 0 < labels_zeros < 10000 and records[0]["total"] == 10000


# --------------------------------------------------------------------------- real runs


def _evaluate(tmp_path, name, *extra) -> tuple[dict, str]:
    from .conftest import MNIST_DIR

    out = tmp_path / name
    code = main(["evaluate", "--mnist-dir", str(MNIST_DIR), "--output", str(out), *extra])
    assert code == 0
    return json.loads((out / "summary.json").read_text()), str(out)


@pytest.mark.slow
def test_evaluate_draw0_in_process(mnist_dir, tmp_path, capsys, run_record):
    summary, out = _evaluate(tmp_path, "report", "--draws", "0", "--backend", "cpu")
    printed = capsys.readouterr().out
    (d,) = summary["draws"]
    assert (d["draw"], d["dataset_seed"], d["correct"], d["total"]) == (0, 2026091400, 8887, 10000)
    assert d["accuracy"] == 0.8887
    assert d["predictions_sha256"] == DRAW0_PREDICTIONS_SHA256
    assert d["input_hashes"]["train_labels"] == run_record["metadata"]["input_hashes"]["train_labels"]
    assert d["backend"] == "cpu" and d["training_prediction_seconds"] > 0 and d["wall_seconds"] > 0
    preds = np.load(f"{out}/predictions/draw-00.npy")
    assert preds.dtype == np.int64 and preds.shape == (10000,)
    assert array_sha256(preds) == DRAW0_PREDICTIONS_SHA256
    t = summary["totals"]
    assert (t["correct"], t["total"], t["correct_over_total"]) == (8887, 10000, "8,887 / 10,000")
    assert t["mean_error_exact"] == "1113/10000" and t["sd_accuracy_pp"] is None
    assert {b["band_percent"]: b["met"] for b in t["error_bands"]} == {
        2: False,
        3: False,
        5: False,
        8: False,
        12: True,
    }
    assert summary["config"] == Config().as_dict() and summary["mode"] == "in-process"
    assert summary["versions"]["evaluator"]["torch"] and summary["elapsed_seconds"] > 0
    for text in (printed, open(f"{out}/README.md").read()):
        assert "| 0 | 2026091400 | 8,887 / 10,000 | 88.87 % |" in text
        assert "12 % met" in text and "8 % not met" in text
    root = ET.parse(f"{out}/accuracy.svg").getroot()
    assert len(root.findall(f"{SVG}circle[@class='draw']")) == 1


@pytest.mark.slow
def test_evaluate_two_draws_through_server(tmp_path):
    local, _ = _evaluate(tmp_path, "local", "--draws", "0-1", "--backend", "cpu")
    with running_server(tmp_path, env={"REV88_BACKEND": "cpu"}) as server:
        remote, out = _evaluate(tmp_path, "remote", "--draws", "0,1", "--backend", "cpu", "--url", server.url)
    assert remote["mode"] == "service" and remote["url"] == server.url
    key = (
        "draw",
        "dataset_seed",
        "correct",
        "total",
        "input_hashes",
        "query_labels_sha256",
        "predictions_sha256",
    )
    assert [{k: d[k] for k in key} for d in remote["draws"]] == [
        {k: d[k] for k in key} for d in local["draws"]
    ]
    assert remote["draws"][0]["predictions_sha256"] == DRAW0_PREDICTIONS_SHA256
    assert remote["draws"][0]["correct"] == 8887
    assert all(d["service"]["id"] and d["backend"] == "cpu" for d in remote["draws"])
    assert remote["totals"] == local["totals"]
    assert remote["versions"]["service"]
    for k in (0, 1):
        assert np.array_equal(
            np.load(f"{out}/predictions/draw-{k:02d}.npy"),
            np.load(f"{tmp_path}/local/predictions/draw-{k:02d}.npy"),
        )
