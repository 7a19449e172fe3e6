"""What a run tells its user: a progress bar, metrics files, the loss history, XLA advice.

Everything here runs on the master replica only. Losses stay on the device until a flush
(every ``log_every`` steps), which fetches them in one transfer, so logging never adds a
device-to-host transfer per step.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tiekit.devices import to_host

#: Steps after which XLA should not compile anything new (the first steps compile the graphs).
WARMUP_STEPS = 3


class PerformanceWarning(UserWarning):
    """A run is slower than it needs to be (recompilations, host transfers in the step)."""


class TrainLog:
    """Progress bar (tqdm), ``metrics.csv`` (and TensorBoard when installed), loss history."""

    def __init__(
        self,
        *,
        enabled: bool,
        progress: bool,
        total_steps: int | None,
        start_step: int,
        samples_per_step: int,
        log_dir: Path | None,
        log_every: int,
        compilations: Callable[[], int] | None = None,
        fetched: Callable[[list[tuple[int, float]]], None] | None = None,
    ) -> None:
        """``fetched`` is given every ``(step, loss)`` the log fetches from the device."""
        self.enabled = enabled
        self._fetched = fetched
        self.samples_per_step = samples_per_step
        self.log_every = log_every
        self.xla = compilations is not None
        self._compilations = compilations or (lambda: 0)
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self._pending: list[tuple[int, int, torch.Tensor]] = []
        self._start_step = start_step
        self._timed_from: tuple[int, float] | None = None
        self._ended: float | None = None
        self._last_time = time.perf_counter()
        self._compiles_after_warmup: int | None = None
        self._warned: set[str] = set()
        self._bar: Any = None
        self._csv: Any = None
        self._writer: Any = None
        self._board: Any = None
        if not enabled:
            return
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._csv = (log_dir / "metrics.csv").open("a", newline="", encoding="utf-8")
            self._writer = csv.writer(self._csv)
            if self._csv.tell() == 0:
                self._writer.writerow(["step", "epoch", "loss", "val_loss", "samples_per_second", "elapsed_seconds"])
            if importlib.util.find_spec("tensorboard") is not None:
                board: Any = importlib.import_module("torch.utils.tensorboard")
                self._board = board.SummaryWriter(str(log_dir))
        self._started = time.perf_counter()

    def step(self, step: int, epoch: int, loss: torch.Tensor, host_transfers: int = 0) -> None:
        """Record step ``step``'s loss (still on the device); flush every ``log_every`` steps."""
        if not self.enabled:
            return
        self._pending.append((step, epoch, loss))
        if step - self._start_step == WARMUP_STEPS:
            # Graphs are compiled by now: time from here on, and watch for new compilations.
            self._timed_from = (step, time.perf_counter())
            if self.xla:
                self._compiles_after_warmup = self._compilations()
        if self.xla and host_transfers and step - self._start_step > WARMUP_STEPS:
            self._warn_once(
                "transfers",
                f"step {step} made {host_transfers} device-to-host transfer(s) (.item(), .cpu(), printing a "
                "tensor...): each one cuts the XLA graph and waits for the device. Keep them out of the step; "
                "tiekit.fit fetches the loss for you every log_every steps.",
            )
        if self._bar is not None:
            self._bar.update(1)
        if len(self._pending) >= self.log_every:
            self.flush()

    def flush(self) -> None:
        """Fetch the pending losses (one transfer), update the bar and the metrics files."""
        if not self.enabled or not self._pending:
            return
        pending, self._pending = self._pending, []
        # Converted on the host: a conversion on the device would be one more graph to compile.
        values = [float(v.float()) for v in to_host([loss for _, _, loss in pending])]
        self.losses.extend(values)
        if self._fetched is not None:
            self._fetched([(step, v) for (step, _, _), v in zip(pending, values, strict=True)])
        diverged = next(
            ((step, v) for (step, _, _), v in zip(pending, values, strict=True) if not math.isfinite(v)), None
        )
        if diverged is not None and "diverged" not in self._warned:
            self._warned.add("diverged")
            # A warning only: the ranks stop together at the next save (`Coordinator.check_finite`).
            warnings.warn(
                f"the loss of step {diverged[0]} is {diverged[1]}: training has diverged", UserWarning, stacklevel=3
            )
        rate = self.samples_per_second
        elapsed = time.perf_counter() - self._started
        for (step, epoch, _), value in zip(pending, values, strict=True):
            if self._writer is not None:
                self._writer.writerow([step, epoch, f"{value:.6g}", "", f"{rate:.6g}", f"{elapsed:.3f}"])
            if self._board is not None:
                self._board.add_scalar("loss", value, step)
        if self._board is not None:
            self._board.add_scalar("samples_per_second", rate, pending[-1][0])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values[-1]:.4f}", samples_per_s=f"{rate:.1f}", refresh=False)
        if self._csv is not None:
            self._csv.flush()
        self._check_compilations(pending[-1][0])

    @contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Work between steps (validation, checkpoints): its compilations are expected, not warned about."""
        counting = self._compiles_after_warmup is not None
        before = self._compilations() if counting else 0
        try:
            yield
        finally:
            if counting and self._compiles_after_warmup is not None:
                self._compiles_after_warmup += self._compilations() - before

    def validation(self, step: int, epoch: int, val_loss: float) -> None:
        """Record the validation loss after step ``step``, after the steps' losses still pending
        (fetched now: the rows of ``metrics.csv`` stay in step order)."""
        if not self.enabled:
            return
        self.flush()
        self.val_losses.append(val_loss)
        if self._writer is not None:
            self._writer.writerow([step, epoch, "", f"{val_loss:.6g}", "", ""])
        if self._board is not None:
            self._board.add_scalar("val_loss", val_loss, step)
        if self._bar is not None:
            self._bar.write(f"epoch {epoch}: val_loss {val_loss:.4f}")

    @property
    def samples_per_second(self) -> float:
        """Throughput of all replicas together since the warm-up steps (0.0 before)."""
        if self._timed_from is None:
            return 0.0
        step = self._start_step + len(self.losses) + len(self._pending)
        seconds = (self._ended or time.perf_counter()) - self._timed_from[1]
        return (step - self._timed_from[0]) * self.samples_per_step / seconds if seconds > 0 else 0.0

    def stop_clock(self) -> None:
        """Flush (fetching the last loss waits for the last step) and stop the throughput clock."""
        self.flush()
        if self._ended is None:
            self._ended = time.perf_counter()

    def close(self) -> None:
        self.stop_clock()
        if self._bar is not None:
            self._bar.close()
        if self._csv is not None:
            self._csv.close()
        if self._board is not None:
            self._board.close()

    def _check_compilations(self, step: int) -> None:
        if self._compiles_after_warmup is None:
            return
        new = self._compilations() - self._compiles_after_warmup
        if new > 0:
            self._warn_once(
                "compilations",
                f"XLA compiled {new} new graph(s) after the first {WARMUP_STEPS} steps (at step {step}): the step's "
                "shapes or control flow keep changing, and each new graph costs a compilation. Keep batch shapes "
                "static (drop_last=True or padding) and avoid data-dependent Python branches in forward.",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, PerformanceWarning, stacklevel=4)
