"""Watching the losses of a run for divergence between checkpoints: a diverged run must stop
before its next save, which with ``checkpoint_keep`` would push the good checkpoints out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tiekit import devices


@dataclass
class LossWatch:
    """This rank's losses since the last save, for `Coordinator.check_finite`. They stay on the
    device and are fetched in one transfer every ``every`` steps, so at most that many are held
    however far apart the saves are; the first one that was not finite is kept. On the master,
    the log fetches them and hands them over (`seen`)."""

    every: int
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    first_bad: tuple[int, float] | None = None

    def add(self, step: int, loss: torch.Tensor) -> None:
        """Record step ``step``'s loss (on the device). Local."""
        self.pending.append((step, loss))
        if len(self.pending) >= self.every:
            self.fetch()

    def seen(self, values: list[tuple[int, float]]) -> None:
        """Record losses already on the host, as ``(step, value)``: the master's log fetches its
        own, and fetching them here too would cost a second transfer. Local."""
        if self.first_bad is None:
            self.first_bad = next(((s, v) for s, v in values if not math.isfinite(v)), None)

    def fetch(self) -> tuple[int, float] | None:
        """The first ``(step, loss)`` since the last `clear` that was NaN or infinite, or None. Local."""
        if self.pending:
            values = devices.to_host([loss for _, loss in self.pending])  # the steps are done: no wait
            self.seen([(s, float(v.float())) for (s, _), v in zip(self.pending, values, strict=True)])
            self.pending = []
        return self.first_bad

    def clear(self) -> None:
        """Forget the losses: a save has checked them. Local."""
        self.pending, self.first_bad = [], None
