"""The learner's shape, in numbers: the coupling branches' width, the lifted features, the classes
and the parameter count they make. A module of its own, without torch, so that what only counts
(``learner.budget``, the service's settings, the command line's ``--help``) imports no torch;
``learner.model`` builds the model from these and re-exports them."""

from __future__ import annotations

WIDTH = 41
FEATURES = 2 * WIDTH  # 81 pixels + 1 appended zero
CLASSES = 10


def parameter_count(depth: int) -> int:
    """The learner's parameters: ``depth`` coupling blocks of two WIDTH x WIDTH weights, the head."""
    return 2 * depth * WIDTH * WIDTH + CLASSES * FEATURES + CLASSES
