"""``rev88 dataset put|show``: a task npz stored on the service once, under its SHA-256, and its
scoring labels (docs/sweeps.md); ``rev88 submit --dataset DIGEST`` then trains on it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .common import CliError
from .tasks import _add_client_flags, _client_errors, open_client


@_client_errors
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
    _add_client_flags(p, "seconds to wait for each answer (default 600)", 600.0)
    p.set_defaults(func=cmd_dataset)
