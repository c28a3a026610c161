"""Three of a sweep cell's host costs, in process: recording a sweep's cells, encoding a stored
answer, claiming queued cells on SQLite.

    record   ``Ledger.create_many`` of a sweep's cells (``--cells``) on a fresh SQLite ledger
    encode   ``encode_answer`` of a draw-0 answer (10,000 class indices), as the ledger writer stores it
    claim    ``LocalClaims.claim`` of those cells, ``--launch`` at a time, until none waits

CPU time of this process (``time.process_time``), ``--rounds`` times each, the minimum and the
median; nothing here is a pass/fail threshold. ``--tree DIR`` measures another checkout's code
(a worktree of an earlier commit, for before and after in one sitting; run the two alternately):

    python bench/bench_host_parts.py [--cells 1320] [--launch 132] [--rounds 5] [--tree DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path


def cells(n: int) -> list[dict]:
    """A sweep's cells as ``create_many`` takes them: one dataset, one grid point a seed."""
    options = {"include_scores": False, "measure": None, "dataset": "sha256:" + "a" * 64, "sweep": "sw-bench",
               "owner": None}
    hashes = {k: "b" * 64 for k in ("train_images", "train_labels", "test_images")}
    return [dict(task_id=uuid.uuid4().hex, kind="task", mode="async", backend="cpu-fast",
                 config={"seed": i, "learning_rate": 0.1, "epochs": 4, "batch_size": 32, "depth": 2},
                 options=dict(options), train_count=10_000, test_count=10_000, body_sha256="a" * 64,
                 body_bytes=6_500_000, input_hashes=dict(hashes)) for i in range(n)]


def timed(fn, rounds: int) -> dict:
    times = []
    for _ in range(rounds):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    times.sort()
    return {"min_ms": round(times[0] * 1e3, 2), "median_ms": round(times[len(times) // 2] * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=1320)
    parser.add_argument("--launch", type=int, default=132)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    import numpy as np

    from app.ledger.local_claims import LocalClaims
    from app.ledger.rows import encode_answer
    from app.ledger.store import Ledger

    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(Path(tmp) / "data")
        record = timed(lambda: ledger.create_many(cells(args.cells)), args.rounds)

        def claim_all() -> None:
            made = cells(args.cells)
            ledger.create_many(made)
            claims = LocalClaims(ledger)
            for i, cell in enumerate(made):
                claims.add(cell["task_id"], None, 1000.0 + i)
            c0 = time.process_time()
            while len(claims):
                claims.claim(args.launch)
            claim_s.append(time.process_time() - c0)

        claim_s: list[float] = []
        for _ in range(args.rounds):
            claim_all()
        ledger.close()
    claim_s.sort()
    predictions = np.random.default_rng(0).integers(0, 10, 10_000)
    answer = {"id": "t", "predictions": predictions, "predictions_sha256": "c" * 64, "scores_sha256": "d" * 64,
              "timing": {"run_ms": 1.0, "total_ms": 2.0}, "energy": None}
    encode = timed(lambda: [encode_answer(answer) for _ in range(1000)], args.rounds)
    doc = {"tree": args.tree, "cells": args.cells,
           "record_ms": record,
           "encode_answer_us": {k.replace("_ms", "_us"): v for k, v in encode.items()},  # (1,000 of them: ms = us each)
           "claim_ms": {"min_ms": round(claim_s[0] * 1e3, 2), "median_ms": round(claim_s[len(claim_s) // 2] * 1e3, 2)},
           "claims_of": args.launch}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
