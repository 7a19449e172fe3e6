"""Shared timing helper for the benchmark scripts: best of interleaved repeats, GC paused."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def best_times(fns: dict[str, Callable[[], object]], repeats: int = 15) -> dict[str, float]:
    """Best wall time of each function over ``repeats`` rounds, run interleaved so that
    machine noise hits every contender alike; GC is paused while timing."""
    best = dict.fromkeys(fns, float("inf"))
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        gc.enable()
    return best
