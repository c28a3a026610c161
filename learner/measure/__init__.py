"""Time and energy per task.

``paired`` is the reference record's paired-idle protocol and its pure arithmetic (``window``,
``trial_figures``, ``summarize``, ``repeats_for``, ...), re-exported here as before; ``gated`` is
the gated protocol built on it (two meters, reference windows, a sham, a harness control and
gates), ``figures`` every figure and gate of a gated record from its raw readings, ``gates`` the
thresholds, reference bands and gate functions, ``idle`` the cold idle and the slope-tested
settles both protocols use, ``analyze`` the re-analysis of a stored record. The devices and
meters they use are in ``learner.energy``. docs/energy.md describes the gated protocol.
"""

__all__ = [
    "MAX_REPEATS", "MEMORY_SCOPE", "MIN_REPEATS", "SCOPE", "STATE_HASH_KEYS", "SUMMARY_KEYS", "ProtocolError",
    "check_protocol", "compare_runs", "cpu_hardware", "measure_run", "measure_task", "repeats_for", "software",
    "summarize", "summary", "timing_stats", "trial_figures", "window",
]


def __getattr__(name: str):
    """``paired``'s names, imported on first use (it imports torch; ``gates`` alone does not)."""
    if name in __all__:
        from . import paired

        return getattr(paired, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
