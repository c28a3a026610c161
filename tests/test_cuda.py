"""CUDA backend: captured graphs against independent eager autograd. Needs a GPU.

Without one these tests skip with that reason; scripts/gpu_check.py runs the full set
(including the 10k/10k draw) on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import make_config
from learner.reference_check import TOLERANCE, max_violation, ordinary_sgd
from learner.train import prepare

from .helpers import small_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]


@pytest.mark.parametrize("depth", [1, 2])
def test_graph_replay_matches_independent_eager(depth):
    from learner.backends.cuda import GraphBackend

    config = make_config({"depth": depth, "seed": 781, "batch_size": 8})
    task = small_task(n=19, m=7, seed=depth)
    backend = GraphBackend("cuda")
    out = backend.run(task, prepare(task, config))
    ref_p, ref_v, ref_scores = ordinary_sgd(task, config)
    ok_p, _ = max_violation(out.final_parameters, ref_p, **TOLERANCE)
    ok_v, _ = max_violation(out.final_velocity, ref_v, **TOLERANCE)
    assert ok_p and ok_v
    assert (out.scores.argmax(1) == ref_scores.argmax(1)).all()
    again = backend.run(task, prepare(task, config))
    assert again.extra["graph_reused"] and again.scores.tobytes() == out.scores.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again.final_parameters, out.final_parameters))
    assert out.cuda_ms is not None and out.cuda_ms > 0
