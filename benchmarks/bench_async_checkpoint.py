"""Training time lost per checkpoint in `tiekit.fit`, background saves against blocking ones (issue 12).

Target: with background saves (``checkpoint_async=True``, the default) the step time lost per
checkpoint is at most 20% of what a blocking save (``checkpoint_async=False``) loses.

A tied LM of 8.4 M parameters (vocabulary 32,000 x 256, so a 34 MB tie group and 100 MB of
checkpoint with AdamW's moments) trains ``--steps`` steps, saving every ``--every``. The loss
per checkpoint is the training-loop time (fit's own throughput clock, which runs from the warm-up
to the last step, so it holds every in-loop save and not the final wait for the last write)
minus that of the same run without checkpoints, over the number of saves. Runs alternate
between the three modes; medians over ``--repeats``. ``--strategy fsdp`` runs on 2 CPU
processes (gloo) with sharded `tiekit.save_sharded` folders; ``--strategy xla`` on one XLA device
(run with ``PJRT_DEVICE=CPU``: XLA:CPU), its weights copied from the device in the save call.

``--threads N`` gives the training N torch threads (under ``fsdp``: each rank; fit otherwise
gives a rank its share of the cores). By default it uses every core, so
on a small machine the background writer competes with training for CPU (the kernel's work of
writing 95 MB to the page cache is 25-290 ms of CPU here); ``--threads 1`` on 2 cores leaves one
free, as an accelerator host has cores to spare while the step runs on the device.

``--ranks N`` sets the number of ``fsdp`` processes (2 by default): with ``--ranks 1 --threads 1``
the one rank leaves a core free for its background writer, as the single-process run with
``--threads 1`` does (on this 2-core machine two ranks take both cores).

``--keep N`` passes ``checkpoint_keep=N`` to fit: each new file is then written into the page
cache of the one deleted before it, not into memory the kernel has to grow into.

Two measures of the loss per checkpoint. *Across runs*: the loop time of a run with saves minus
that of the same run without, over the saves; it carries the whole run-to-run spread of this
machine (0.5-1 s over 5 saves), as much as the effect measured. *Within a run*: every step's
duration is recorded (the master's step clock); a save's loss is the time the ``--window``
steps after it took beyond the run's typical step (the median of the steps outside those
windows), so a run is compared only with itself. The write of a background save must finish
inside its window (the script prints the steps outside the windows against those of the runs
without checkpoints, so a write spilling past its window shows).

Two more within-run measures: *paired*, each save's window minus the ``--window`` steps just
before it, with its standard error over every save; and the *cycle profile*, the median step at
each position between two saves, whose first ``--window`` positions (the save call, the steps
beside the write) are compared with the positions after them. Last, the kernel CPU of writing
one save's file (``/proc/stat``: system, irq and softirq time), which a background save takes
from the step whatever thread writes when every core computes. The run fixes glibc's malloc
thresholds for every mode (`MALLOC_SETTINGS`; ``--malloc-default`` keeps glibc's own).

    .venv/bin/python benchmarks/bench_async_checkpoint.py [--strategy single|fsdp|xla] [--ranks 2] [--repeats 5]
        [--threads N] [--keep N] [--steps 43 --every 8 --window 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tiekit

VOCAB, WIDTH, LENGTH, BATCH, WARMUP = 32_000, 256, 16, 8, 3


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


def build() -> TiedLM:
    return TiedLM()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def corpus(count: int = 4096) -> TensorDataset:
    ids = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


#: Seconds the training loop spent inside each checkpoint call of fit (``Coordinator.save``), in
#: this process: the stall a save puts into the loop, without what a background write costs the
#: steps it runs beside (which the loop seconds hold).
STALLS: list[float] = []


#: Where the master writes the end time of every step of a run (set per run by `loop_seconds`;
#: spawned processes inherit it).
STEP_TIMES_FILE = "TIEKIT_BENCH_STEP_TIMES"


def _timed_steps() -> None:
    """Record when each of fit's steps ended on the master, and write the times out when the run
    closes its log. Patched at import, so the processes fit spawns (which import this script) do
    it too."""
    from tiekit.train.log import TrainLog

    step, close = TrainLog.step, TrainLog.close

    def timed_step(self: TrainLog, *args: Any, **kwargs: Any) -> None:
        if self.enabled:
            self.__dict__.setdefault("bench_times", []).append(time.perf_counter())
        step(self, *args, **kwargs)

    def timed_close(self: TrainLog) -> None:
        close(self)
        target = os.environ.get(STEP_TIMES_FILE)
        if self.enabled and target:
            Path(target).write_text("\n".join(repr(t) for t in self.__dict__.get("bench_times", [])))

    TrainLog.step = timed_step  # type: ignore[method-assign]
    TrainLog.close = timed_close  # type: ignore[method-assign]


_timed_steps()

#: The torch threads of every training process (set by ``--threads``; spawned ranks inherit it).
THREADS = "TIEKIT_BENCH_THREADS"


def _rank_threads() -> None:
    """Spawned ranks take ``$TIEKIT_BENCH_THREADS`` torch threads once fit has given them their
    share of the cores (it does so when they join the process group)."""
    from tiekit.train import launch

    join = launch.join_process_group

    def joined(*args: Any, **kwargs: Any) -> torch.device:
        device = join(*args, **kwargs)
        if os.environ.get(THREADS):
            torch.set_num_threads(int(os.environ[THREADS]))
        return device

    launch.join_process_group = joined


_rank_threads()


def _timed_saves() -> None:
    from tiekit.train.coordinate import Coordinator

    save = Coordinator.save

    def timed(self: Coordinator, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            save(self, *args, **kwargs)
        finally:
            STALLS.append(time.perf_counter() - started)

    Coordinator.save = timed  # type: ignore[method-assign]


def loop_seconds(
    strategy: str, steps: int, every: int, mode: str, folder: Path, keep: int | None = None, ranks: int = 2
) -> tuple[float, list[float]]:
    """Seconds of fit's training loop after the warm-up steps, saves in the loop included, and the
    duration of every step after the first (step ``i``'s entry runs from the end of step ``i``
    to the end of step ``i + 1``, so it holds a save made after step ``i``)."""
    kw: dict[str, Any] = {"loss_fn": lm_loss, "max_steps": steps, "batch_size": BATCH, "progress": False}
    if strategy == "fsdp":
        kw |= {"strategy": "fsdp", "devices": ranks}
    elif strategy == "xla":
        kw |= {"strategy": "xla", "devices": 1}  # one XLA device (PJRT_DEVICE=CPU: XLA:CPU)
    else:
        kw |= {"devices": "cpu"}
    if mode != "none":
        kw |= {"checkpoint_dir": folder, "checkpoint_every": every, "checkpoint_async": mode == "async"}
        kw["checkpoint_keep"] = keep
    times_file = folder.parent / f"{folder.name}.steps"
    os.environ[STEP_TIMES_FILE] = os.fspath(times_file)
    try:
        result = tiekit.fit(build, corpus(), **kw)
    finally:
        del os.environ[STEP_TIMES_FILE]
    ends = [float(line) for line in times_file.read_text().split()]
    times_file.unlink()
    if len(ends) != steps:
        raise RuntimeError(f"recorded {len(ends)} step times for {steps} steps")
    durations = [b - a for a, b in itertools.pairwise(ends)]
    return (steps - WARMUP) * BATCH * result.world_size / result.samples_per_second, durations


def windows(steps: int, every: int, window: int) -> set[int]:
    """Indexes into `loop_seconds`' durations that follow an in-loop save by at most ``window``
    steps (duration ``i`` ends at step ``i + 2``)."""
    saves = range(every, steps, every)  # the last step's save is not in the loop
    return {s - 1 + k for s in saves for k in range(window) if s - 1 + k < steps - 1}


def lost_within(durations: list[float], inside: set[int]) -> tuple[float, float]:
    """(time the steps inside the windows took beyond the run's typical step, that typical step):
    the typical step is the median of the steps outside the windows and after the warm-up."""
    outside = [d for i, d in enumerate(durations) if i not in inside and i >= WARMUP]
    typical = statistics.median(outside)
    return sum(durations[i] - typical for i in inside), typical


def paired_losses(durations: list[float], steps: int, every: int, window: int) -> list[float]:
    """Each in-loop save's loss against the steps just before it: the ``window`` steps after the
    save minus the ``window`` steps before it (outside every save's window, since ``every`` is at
    least twice ``window``). A run's drift (its typical step moving by 30% between runs on this
    VM, and within a run) cancels out of each pair; what stays is the save and the steps' own
    jitter, which the standard error over all saves shows."""
    losses = []
    for s in range(every, steps, every):
        after = [s - 1 + k for k in range(window)]
        before = [s - 1 - window + k for k in range(window)]
        if before[0] >= WARMUP and after[-1] < steps - 1:
            losses.append(sum(durations[i] for i in after) - sum(durations[i] for i in before))
    return losses


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error."""
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def cycle_profile(durations: list[float], every: int) -> list[float]:
    """The median step (ms) at each position of the save cycle: position 0 holds the save call
    and the step that runs beside a background write, position ``every - 1`` the step before the
    next save."""
    return [
        statistics.median(d for i, d in enumerate(durations) if i >= every and (i + 1) % every == k) * 1e3
        for k in range(every)
    ]


def kernel_cpu_of_writing(size: int, folder: Path, rounds: int = 10) -> float | None:
    """Milliseconds of CPU the kernel spends (system, irq and softirq time of the whole machine,
    from ``/proc/stat``) per file of ``size`` bytes written as background saves write them
    (``O_DIRECT`` from aligned memory). Interrupt handling lands on whichever core, so beside a
    step that keeps every core busy this much is taken from the step whatever thread writes.
    None where ``/proc/stat`` or ``O_DIRECT`` is missing."""
    from tiekit.checkpoint.direct import aligned, open_new, round_up, write_all

    if not hasattr(os, "O_DIRECT") or not Path("/proc/stat").exists():
        return None

    def kernel_jiffies() -> int:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return sum(int(fields[i]) for i in (3, 6, 7))  # system, irq, softirq

    memory = aligned(round_up(size)).fill_(1).numpy()
    target = folder / "kernel-cpu.bin"
    before = kernel_jiffies()
    for _ in range(rounds):
        fd = open_new(target, direct=True)
        try:
            write_all(fd, memory.data, 0)
        finally:
            os.close(fd)
    ticks = kernel_jiffies() - before
    target.unlink()
    return ticks / os.sysconf("SC_CLK_TCK") / rounds * 1e3


#: glibc's malloc settings, fixed for every mode of a run. By default glibc serves each
#: allocation above a threshold that starts at 128 KiB with mmap, and gives the top of its heap
#: back to the system beyond 128 KiB free; both rise when a large block is freed. A step's large
#: temporaries (the logits and the 33 MB gradient of the tied embedding here) are then mapped or
#: grown into and given back every step, page faults included, until something frees a large
#: block (most likely a run's first background save, which moves the parameters and moments into
#: its file image and frees the originals): the background runs' steps took 57 ms where the
#: others took 72-78 ms (2 threads), a difference no save makes. Fixing both for every mode takes that accident out of
#: the comparison (a bare loop of this model: 53 ms instead of 74 ms; the mmap threshold alone,
#: 77 ms; with the trim threshold at 64 MiB, 75 ms).
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "fsdp", "xla"], default="single")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=43)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the training (each rank's)")
    parser.add_argument("--ranks", type=int, default=2, help="fsdp processes")
    parser.add_argument("--keep", type=int, default=None, help="fit's checkpoint_keep (default: keep all)")
    parser.add_argument("--window", type=int, default=4, help="steps after a save that count its loss (within a run)")
    parser.add_argument(
        "--malloc-default",
        action="store_true",
        help="keep glibc's dynamic malloc thresholds (by default the run fixes them, see MALLOC_SETTINGS)",
    )
    args = parser.parse_args()
    if not args.malloc_default and sys.platform == "linux" and not MALLOC_SETTINGS.keys() <= os.environ.keys():
        # glibc reads them at process start, and fit's spawned ranks inherit the environment.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_SETTINGS})
    if 2 * args.window > args.every:
        parser.error("--every must be at least twice --window: each save is compared with the steps before it")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ[THREADS] = str(args.threads)
    _timed_saves()
    stalls: dict[str, list[float]] = {"blocking": [], "async": []}
    saves = len(range(args.every, args.steps + 1, args.every))
    seconds: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
    inside = windows(args.steps, args.every, args.window)
    within: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}  # ms lost per save, per run
    typical: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
    pairs: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}  # ms, every save of every run
    cycles: dict[str, list[list[float]]] = {"none": [], "blocking": [], "async": []}
    save_bytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for mode in seconds:
                folder = Path(tmp) / f"{mode}-{repeat}"
                STALLS.clear()
                value, durations = loop_seconds(
                    args.strategy, args.steps, args.every, mode, folder, args.keep, args.ranks
                )
                if repeat:
                    lost, step = lost_within(durations, inside)
                    within[mode].append(lost / saves * 1e3)
                    typical[mode].append(step * 1e3)
                    pairs[mode] += [x * 1e3 for x in paired_losses(durations, args.steps, args.every, args.window)]
                    cycles[mode].append(cycle_profile(durations, args.every))
                if repeat and mode in stalls:
                    stalls[mode].extend(STALLS[:saves])  # the in-loop saves (not the final one)
                if mode == "blocking" and args.strategy != "fsdp":  # one save's bytes: its largest file
                    save_bytes = max((p.stat().st_size for p in folder.rglob("*") if p.is_file()), default=0)
                # Freed page cache is what the next run writes into. On this VM, page cache grown
                # into memory the guest never touched costs ~10x the CPU per byte written (95 MB:
                # 300-400 ms instead of 25-35 ms), which would bill the machine's history to a mode.
                shutil.rmtree(folder, ignore_errors=True)
                if repeat:
                    seconds[mode].append(value)
        kernel_ms = kernel_cpu_of_writing(save_bytes, Path(tmp)) if save_bytes else None
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    lost = {mode: (median[mode] - median["none"]) / saves for mode in ("blocking", "async")}
    print(
        f"strategy={args.strategy}: {args.steps} steps, {saves} saves, repeats {args.repeats}, "
        f"torch threads {torch.get_num_threads()} of {os.cpu_count()} cores, checkpoint_keep {args.keep}"
        + (f", {args.ranks} rank(s)" if args.strategy == "fsdp" else "")
    )
    for mode, values in seconds.items():
        print(f"  loop seconds {mode:8s}: median {median[mode]:.3f}  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"  lost per checkpoint: blocking {lost['blocking'] * 1e3:.1f} ms, background {lost['async'] * 1e3:.1f} ms")
    print(f"  background / blocking: {lost['async'] / lost['blocking']:.3f}x (target at most 0.20x)")
    print(f"  within each run ({args.window} steps after each save against the run's typical step):")
    for mode, values in within.items():
        steps_ms = ", ".join(f"{v:.1f}" for v in typical[mode])
        print(
            f"    {mode:8s}: lost per checkpoint median {statistics.median(values):.1f} ms "
            f"({', '.join(f'{v:.1f}' for v in values)}); typical step {steps_ms} ms"
        )
    paired = [a / b for a, b in zip(within["async"], within["blocking"], strict=True)]
    ratio = statistics.median(within["async"]) / statistics.median(within["blocking"])
    print(
        f"  within runs, background / blocking: {ratio:.3f}x of the medians; per round "
        f"{', '.join(f'{r:.3f}' for r in paired)} (target at most 0.20x)"
    )
    print(f"  each save against the {args.window} steps before it (mean +- standard error over every save):")
    paired_mean = {mode: mean_and_error(values) for mode, values in pairs.items()}
    for mode, (mean, error) in paired_mean.items():
        print(f"    {mode:8s}: {mean:6.1f} +- {error:4.1f} ms over {len(pairs[mode])} saves")
    floor = paired_mean["none"][0]
    cost = {mode: paired_mean[mode][0] - floor for mode in ("blocking", "async")}
    spread = (paired_mean["async"][1] ** 2 + paired_mean["none"][1] ** 2) ** 0.5
    print(
        f"  paired, beyond the runs without checkpoints: blocking {cost['blocking']:.1f} ms, background "
        f"{cost['async']:.1f} +- {spread:.1f} ms: {cost['async'] / cost['blocking']:.3f}x "
        f"(+- {spread / cost['blocking']:.3f}; target at most 0.20x)"
    )
    print("  median step (ms) at each position of the save cycle (0: the save call and the step beside its write):")
    # The window's positions beyond the positions after it (a write may spill into position 1).
    excess = {}
    for mode, profiles in cycles.items():
        positions = [statistics.median(p[k] for p in profiles) for k in range(args.every)]
        rest = statistics.median(positions[args.window :])
        excess[mode] = sum(positions[: args.window]) - args.window * rest
        cells = " ".join(f"{m:6.1f}" for m in positions)
        print(f"    {mode:8s}: {cells}   positions 0-{args.window - 1} beyond the rest: {excess[mode]:.1f}")
    step_cost = {mode: excess[mode] - excess["none"] for mode in ("blocking", "async")}
    print(
        f"  cycle profile, beyond the runs without checkpoints: blocking "
        f"{step_cost['blocking']:.1f} ms, background {step_cost['async']:.1f} ms: "
        f"{step_cost['async'] / step_cost['blocking']:.3f}x (target at most 0.20x)"
    )
    if kernel_ms is not None:
        print(
            f"  kernel CPU of writing one save's file ({save_bytes / 1e6:.0f} MB, O_DIRECT, /proc/stat): "
            f"{kernel_ms:.1f} ms = {kernel_ms / step_cost['blocking']:.3f}x of a blocking save's: a background "
            "save loses at least that beside a step that keeps every core busy"
        )
    if args.strategy != "fsdp":  # fsdp saves in the spawned processes, out of this one's sight
        stall = {mode: statistics.median(values) for mode, values in stalls.items()}
        print(
            f"  loop stalled inside a save (median): blocking {stall['blocking'] * 1e3:.1f} ms, "
            f"background {stall['async'] * 1e3:.1f} ms: {stall['async'] / stall['blocking']:.3f}x"
        )


if __name__ == "__main__":
    main()
