"""``rev88 dataset put|show`` and ``rev88 sweep``: a task npz stored on the service once, under its SHA-256, and its
scoring labels (docs/sweeps.md); ``rev88 submit --dataset DIGEST`` then trains on it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from .common import CliError
from .progress import bar as progress_bar
from .tasks import add_client_flags, client_errors, open_client

if TYPE_CHECKING:
    from tqdm import tqdm


@client_errors
def cmd_dataset(args: argparse.Namespace) -> int:
    with open_client(args, args.timeout) as client:
        if args.action == "show":
            print(json.dumps(client.dataset(args.target), indent=2))
            return 0
        path = Path(args.target)
        if not path.is_file():
            raise CliError(f"dataset file not found: {path}", 2)
        dataset = client.put_dataset(path)
        if args.labels is not None:
            try:
                labels = np.load(args.labels, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise CliError(f"cannot read the labels {args.labels}: {exc}", 2) from None
            client.put_labels(dataset, labels)
        print(dataset.digest)
    return 0


def add_dataset(sub) -> None:
    p = sub.add_parser("dataset", help="store a task npz on the service once (put), or describe one (show)",
                       description="put FILE: store the npz under its SHA-256 (sent only when the service does not "
                       "have it) and print its digest; --labels FILE.npy attaches the queries' scoring labels (kept "
                       "by the service, never returned). show DIGEST: what the service knows of it.")
    p.add_argument("action", choices=("put", "show"))
    p.add_argument("target", metavar="FILE|DIGEST")
    p.add_argument("--labels", help="put: an .npy of the query labels (shape (M,), integers 0-9)")
    add_client_flags(p, "seconds to wait for each answer (default 600)", 600.0)
    p.set_defaults(func=cmd_dataset)


# --------------------------------------------------------------------------- sweep


def parse_grid(items: list[str]) -> dict[str, list]:
    """``--grid learning_rate=0.05,0.1`` (repeatable) -> {"learning_rate": [0.05, 0.1]}."""
    grid: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise CliError(f"--grid takes NAME=V1,V2,..., got {item!r}", 2)
        if name in grid:
            raise CliError(f"--grid {name} given twice", 2)
        grid[name] = [_number(v, f"--grid {name}") for v in values.split(",")]
    return grid


def _number(text: str, what: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise CliError(f"{what}: {text!r} is not a number", 2) from None


def parse_seeds(text: str) -> list[int] | dict[str, int]:
    """``0-9`` -> {"start": 0, "count": 10}; ``1,5,7`` -> [1, 5, 7]."""
    if "-" in text and "," not in text:
        first, _, last = text.partition("-")
        start, end = int(_number(first, "--seeds")), int(_number(last, "--seeds"))
        if end < start:
            raise CliError(f"--seeds {text}: the range ends before it starts", 2)
        return {"start": start, "count": end - start + 1}
    return [int(_number(s, "--seeds")) for s in text.split(",")]


class SweepProgress:
    """The cells' bar over ``wait_sweep``'s polls: tqdm on stderr when it is a terminal
    (rev88/cli/progress.py); otherwise one summary line when the wait ends (logs stay readable)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.bar: tqdm | None = None
        self.counts: dict[str, int] | None = None
        self._t0 = time.monotonic()

    def __call__(self, result) -> None:
        counts = self.counts = result.counts
        total = sum(counts.values())
        done = counts["succeeded"] + counts["failed"] + counts["cancelled"]
        if self.bar is None:
            self.bar = progress_bar(total, "sweep", "cell", self.stream)
        self.bar.total = total
        self.bar.set_postfix_str(f"{counts['running']} running, {counts['failed']} failed", refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.close()
        elif self.counts is not None:
            counts = self.counts
            done = counts["succeeded"] + counts["failed"] + counts["cancelled"]
            self.stream.write(f"sweep {done}/{sum(counts.values())} cells ({counts['running']} running, "
                              f"{counts['failed']} failed) in {time.monotonic() - self._t0:.1f} s\n")
            self.stream.flush()


@client_errors
def cmd_sweep(args: argparse.Namespace) -> int:
    grid = parse_grid(args.grid or [])
    config = json.loads(args.config) if args.config else {}
    if not isinstance(config, dict):
        raise CliError("--config is a JSON object of config overrides", 2)
    with open_client(args, args.timeout) as client:
        sweep_id = client.sweep(args.dataset, grid=grid, seeds=parse_seeds(args.seeds) if args.seeds else None,
                                backend=args.backend, idempotency_key=args.idempotency_key, **config)
        if not args.wait:
            print(sweep_id)
            return 0
        bar = None if args.no_progress else SweepProgress()
        try:
            result = client.wait_sweep(sweep_id, args.timeout, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        if args.output:
            Path(args.output).write_text(client.sweep_csv(sweep_id))
        counts = result.counts
        print(f"sweep {sweep_id} {result.status}: {counts['succeeded']} succeeded, {counts['failed']} failed, "
              f"{counts['cancelled']} cancelled" + (f"; wrote {args.output}" if args.output else ""))
        return 0 if counts["failed"] == 0 and counts["cancelled"] == 0 else 1


def add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="a grid of configs x seeds over a stored dataset, in one request",
                       description="POST /sweeps: every combination of the --grid values, once per seed, each a "
                       "task on the stored dataset (docs/sweeps.md). Prints the sweep's id, or with --wait its "
                       "outcome (and --output: its table as CSV).")
    p.add_argument("dataset", metavar="DIGEST", help="sha256:<hex> of a stored dataset (rev88 dataset put)")
    p.add_argument("--grid", action="append", metavar="NAME=V1,V2", help="a config key and its values (repeatable)")
    p.add_argument("--seeds", help="0-9 (a range) or 1,5,7 (a list) [default: 0]")
    p.add_argument("--config", help="JSON object of base config overrides")
    p.add_argument("--backend", help="ask for a backend; default: the server's")
    p.add_argument("--idempotency-key", help="sent as Idempotency-Key: the same key gives the same sweep")
    p.add_argument("--wait", action="store_true", help="wait for every cell, with a progress bar on stderr")
    p.add_argument("--no-progress", action="store_true", help="with --wait: no progress bar")
    p.add_argument("--output", help="with --wait: where to write the cell table (CSV)")
    add_client_flags(p, "seconds to wait for the sweep with --wait (default 3600)", 3600.0)
    p.set_defaults(func=cmd_sweep)
