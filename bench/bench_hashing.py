"""A launch's SHA-256s: hashlib one buffer at a time against the sixteen lanes of
learner/sha256_lanes.c (AVX-512), on the buffers a 132-task launch of 10,000 queries hashes.

For each kind of buffer, the same buffers both ways, the fastest of ``--rounds`` (CPU time of
this thread, ``time.thread_time``), and the digests compared. Then ``sha256_many`` on a whole
launch's ``run_digests`` items against hashlib on each, as the finisher had them before. Ratios
in one process; nothing here is a pass/fail threshold.

    python bench/bench_hashing.py [--tasks 132] [--queries 10000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner.hashing import _lanes, _lanes_ready, array_sha256, lanes_speedup, sha256_many, state_vector  # noqa: E402


def fastest(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=132)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not _lanes_ready():
        print("the lanes cannot run here (learner/_sha256_lanes not built, or no AVX-512): nothing to compare",
              file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    n = args.tasks
    kinds = {
        "scores": [rng.random((args.queries, 10), dtype=np.float32) for _ in range(n)],
        "predictions": [rng.integers(0, 10, args.queries, dtype=np.int64) for _ in range(n)],
        "41 x 41 weights": [rng.random((41, 41), dtype=np.float32) for _ in range(8 * n)],
        "head weights": [rng.random((10, 82), dtype=np.float32) for _ in range(2 * n)],
    }
    lanes = _lanes()
    doc: dict = {"tasks": n, "queries": args.queries, "rounds": args.rounds, "kinds": {}}
    for kind, buffers in kinds.items():
        assert lanes.digests(buffers) == [hashlib.sha256(b).hexdigest() for b in buffers], kind
        nbytes = sum(b.nbytes for b in buffers)
        one = fastest(lambda b=buffers: [hashlib.sha256(x).hexdigest() for x in b], args.rounds)
        side = fastest(lambda b=buffers: lanes.digests(b), args.rounds)
        doc["kinds"][kind] = {"buffers": len(buffers), "bytes_each": buffers[0].nbytes,
                              "hashlib_gb_s": round(nbytes / one / 1e9, 2), "lanes_gb_s": round(nbytes / side / 1e9, 2),
                              "ratio": round(one / side, 2)}
    # a launch's items as run_digests makes them: per task its predictions, scores, six parameters,
    # six velocities and the state vector (the six parameters, hashed as one)
    items: list = []
    for t in range(n):
        params = [kinds["41 x 41 weights"][(8 * t + k) % len(kinds["41 x 41 weights"])] for k in range(4)]
        params += [kinds["head weights"][2 * t], rng.random(10, dtype=np.float32)]
        items += [kinds["predictions"][t], kinds["scores"][t], *params, *[p * 2 for p in params], params]

    def before() -> list[str]:  # as finish_task hashed them: each array, the state vector made first
        return [array_sha256(state_vector(i)) if isinstance(i, list) else array_sha256(i) for i in items]

    assert sha256_many(items) == before()
    one = fastest(before, args.rounds)
    many = fastest(lambda: sha256_many(items), args.rounds)
    doc["launch"] = {"items": len(items), "hashlib_ms_per_task": round(one / n * 1e3, 4),
                     "sha256_many_ms_per_task": round(many / n * 1e3, 4), "ratio": round(one / many, 2),
                     "lanes_speedup_measured": round(lanes_speedup(), 2)}
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
