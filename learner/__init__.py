"""rev88: the reversible additive-coupling learner, reproduced exactly.

Importing the package sets CUBLAS_WORKSPACE_CONFIG (unless already set) so
that cuBLAS sees it before CUDA starts; CUDA graph replays are then repeatable.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # learner/kernels/tuned.py CUBLAS_WORKSPACE

__version__ = "0.1.0"

from .config import Config, make_config  # noqa: E402
from .errors import TaskError  # noqa: E402
from .taskio import TaskArrays, load_task, validate_task  # noqa: E402

__all__ = ["Config", "TaskArrays", "TaskError", "load_task", "make_config", "validate_task", "__version__"]
