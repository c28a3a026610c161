"""What every ``rev88`` command shares: the user-facing error and the JSON/npy file writers."""

from __future__ import annotations

import json
from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def predictions_path(output: Path) -> Path:
    """``result.json`` -> ``result.predictions.npy`` beside it."""
    return output.with_name(output.stem + ".predictions.npy")
