"""tiekit.train: a small multi-core training loop that keeps ties (`fit`), see docs/training.md."""

from tiekit.train.api import FitResult, fit
from tiekit.train.log import PerformanceWarning

__all__ = ["FitResult", "PerformanceWarning", "fit"]
