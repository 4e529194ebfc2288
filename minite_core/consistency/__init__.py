"""Execution diagnostics: drift statistics between engines, and op-by-op comparison (`diagnose`)."""
from .stats import DriftStats, drift_stats

__all__ = ["DriftStats", "drift_stats"]
