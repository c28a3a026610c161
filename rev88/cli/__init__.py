"""``rev88 ...``: every command of the learner and the service behind one parser.

Exit status: 0 success, 2 bad input or usage (the message says why), 1 anything else.
Each command lives in a module of this package (learner.py, evaluate.py, measure.py, serve.py,
tasks.py, datasets.py); this package sits above ``learner`` and ``app`` and imports both; neither imports it.
"""

from __future__ import annotations

import argparse
import sys

from learner import __version__
from learner.errors import TaskError

from .common import CliError
from .datasets import add_dataset, add_sweep
from .evaluate import add_evaluate
from .keys import add_keys
from .learner import add_make_task, add_run, add_score
from .measure import add_measure
from .serve import add_serve
from .tasks import add_cancel, add_submit, add_task, add_tasks

COMMANDS = [add_run, add_make_task, add_score, add_evaluate, add_measure, add_serve, add_submit, add_tasks, add_task,
            add_cancel, add_dataset, add_sweep, add_keys]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rev88", description="The rev88 learner and service.")
    parser.add_argument("--version", action="version", version=f"rev88 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TaskError as exc:
        print(f"rev88 {args.command}: error: {exc.message}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"rev88 {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except RuntimeError as exc:  # BackendUnavailable (e.g. backend=cuda without a GPU) is bad input: 2
        print(f"rev88 {args.command}: error: {exc}", file=sys.stderr)
        return 2 if _backend_unavailable(exc) else 1


def _backend_unavailable(exc: RuntimeError) -> bool:
    """Whether ``exc`` is learner.backends' BackendUnavailable, without importing that module
    (it imports torch, which `rev88 --version`, `--help` and the client commands never need):
    raised, it was imported already."""
    backends = sys.modules.get("learner.backends")
    return backends is not None and isinstance(exc, backends.BackendUnavailable)


if __name__ == "__main__":
    sys.exit(main())
