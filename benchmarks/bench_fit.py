"""Cost of `tiekit.fit` against hand-written loops doing the same work (issue 5 targets):

* XLA:CPU, one device: a ``fit`` step costs at most 1.05x a hand-written torch_xla loop
  (MpDeviceLoader, ``xm.optimizer_step``, ``torch_xla.sync``, the loss fetched every 10 steps),
  with the same number of compilations;
* ``strategy="ddp"`` on 2 CPU processes (gloo): at most 1.05x a hand-written DDP loop;
* for the record, Lightning's Trainer on the same model on one CPU process, when installed.

Every contender trains the tied LM of ``examples/tied_lm.py`` (batch 16 per device, AdamW).
The cost of a step is differenced: (cost of a run of ``--steps`` steps - cost of a run of 10
steps) / (``--steps`` - 10), which cancels start-up, compilation and process spawning. Cost is
measured twice: CPU seconds (this process and its children: every core a contender used,
little disturbed by other jobs on a shared machine) and wall seconds. Each comparison runs in
one process, contenders alternating, after one warm-up run each.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_fit.py [--repeats 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples import tied_lm  # noqa: E402

BATCH = 16
WARMUP = 3
LOG_EVERY = 10


def adamw() -> Any:
    return functools.partial(torch.optim.AdamW, lr=3e-3)


# -- contenders (each runs in its own process) -----------------------------------------------------


def fit_xla(steps: int) -> dict[str, Any]:
    import tiekit

    result = tiekit.fit(
        tied_lm.build, tied_lm.corpus(), max_steps=steps, batch_size=BATCH, optimizer=adamw(), progress=False
    )
    return {"samples_per_second": result.samples_per_second, "compilations": result.compilations}


def hand_xla(steps: int) -> dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from torch.utils.data import DataLoader, DistributedSampler
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    import tiekit

    device = torch_xla.device()
    torch.manual_seed(0)
    model = tied_lm.build()
    tiekit.move(model, device)  # a plain .to() would break the tie: keep the work equal
    optimizer = adamw()(model.parameters())
    data = tied_lm.corpus()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = MpDeviceLoader(DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True), device)
    losses: list[torch.Tensor] = []
    started = 0.0
    for step, (ids, targets) in enumerate(loader, start=1):
        loss = model(ids, targets)
        loss.backward()
        xm.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        losses.append(loss.detach())
        if step % LOG_EVERY == 0 or step == steps:
            [float(v) for v in torch_xla._XLAC._xla_get_cpu_tensors(losses)]
            losses = []
        if step == WARMUP:
            started = time.perf_counter()
        if step == steps:
            break
    seconds = time.perf_counter() - started
    return {"samples_per_second": (steps - WARMUP) * BATCH / seconds, "compilations": met.metric_data("CompileTime")[0]}


def fit_ddp(steps: int) -> dict[str, Any]:
    import tiekit

    result = tiekit.fit(
        tied_lm.build,
        tied_lm.corpus(),
        strategy="ddp",
        devices=2,
        max_steps=steps,
        batch_size=BATCH,
        optimizer=adamw(),
        progress=False,
    )
    return {"samples_per_second": result.samples_per_second}


def hand_loop(model: torch.nn.Module, rank: int, steps: int) -> float:
    """The hand-written loop of the 2-process contenders on this rank: fit's data order
    (DistributedSampler, seed 0), AdamW, losses read every ``LOG_EVERY`` steps as fit logs them;
    samples per second over both ranks from the end of the warm-up."""
    from torch.utils.data import DataLoader, DistributedSampler

    optimizer = adamw()(model.parameters())
    data = tied_lm.corpus()
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    losses: list[torch.Tensor] = []
    started = 0.0
    for step, (ids, targets) in enumerate(loader, start=1):
        loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % LOG_EVERY == 0 or step == steps:
            [float(v) for v in losses]
            losses = []
        if step == WARMUP:
            started = time.perf_counter()
        if step == steps:
            break
    return 2 * (steps - WARMUP) * BATCH / (time.perf_counter() - started)


def join_two(rank: int, port: int) -> None:
    """Join this spawned process to a 2-rank gloo group, with fit's thread count and seed."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # as fit (and torchrun) do
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)


def spawn_two(rank_fn: Any, steps: int) -> str:
    """Run ``rank_fn(rank, steps, port, out)`` in 2 spawned processes; what rank 0 wrote to ``out``."""
    import tempfile

    from torch.multiprocessing.spawn import start_processes

    from tiekit.backends.torch_distributed import free_port

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rate")
        start_processes(rank_fn, args=(steps, free_port(), out), nprocs=2, start_method="spawn")
        return Path(out).read_text()


def _hand_ddp_rank(rank: int, steps: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    join_two(rank, port)
    rate = hand_loop(DistributedDataParallel(tied_lm.build()), rank, steps)
    if rank == 0:
        Path(out).write_text(str(rate))
    dist.destroy_process_group()


def hand_ddp(steps: int) -> dict[str, Any]:
    return {"samples_per_second": float(spawn_two(_hand_ddp_rank, steps))}


def fit_cpu(steps: int) -> dict[str, Any]:
    import tiekit

    result = tiekit.fit(
        tied_lm.build,
        tied_lm.corpus(),
        devices="cpu",
        max_steps=steps,
        batch_size=BATCH,
        optimizer=adamw(),
        progress=False,
    )
    return {"samples_per_second": result.samples_per_second}


def lightning_cpu(steps: int) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = tied_lm.build()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(*batch)
            return loss

        def configure_optimizers(self) -> Any:
            return adamw()(self.parameters())

    class Clock(L.Callback):
        started = 0.0
        ended = 0.0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == WARMUP:
                Clock.started = time.perf_counter()
            Clock.ended = time.perf_counter()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
        log_every_n_steps=LOG_EVERY,
    )
    loader = DataLoader(tied_lm.corpus(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(Module(), loader)
    return {"samples_per_second": (steps - WARMUP) * BATCH / (Clock.ended - Clock.started)}


CONTENDERS = {f.__name__: f for f in (fit_xla, hand_xla, fit_ddp, hand_ddp, fit_cpu, lightning_cpu)}


# -- driver ------------------------------------------------------------------------------------------

PAIRS = {
    "xla": ("fit_xla", "hand_xla"),
    "ddp": ("fit_ddp", "hand_ddp"),
    "lightning": ("fit_cpu", "lightning_cpu"),
}
SHORT = 10


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cost(contender: Any, steps: int) -> tuple[float, float, float | None]:
    """(wall, CPU) seconds of one run of ``steps`` steps, and the run's own seconds per 1,000
    samples measured inside its loop from step `WARMUP` on (None if it reports no rate)."""
    gc.collect()
    wall, cpu = time.perf_counter(), _cpu_seconds()
    found = contender(steps)
    rate = found.get("samples_per_second") if isinstance(found, dict) else None
    return time.perf_counter() - wall, _cpu_seconds() - cpu, 1000 / rate if rate else None


def per_step_costs(
    pair: tuple[str, str], steps: int, repeats: int, contenders: dict[str, Any] | None = None
) -> dict[str, dict[str, list[float]]]:
    """Per-step wall and CPU seconds of each contender (differenced between runs of ``steps``
    and `SHORT` steps), and its in-loop seconds per 1,000 samples ("loop", from the longer run),
    ``repeats`` times, alternating, the order flipped every repeat."""
    run = contenders or CONTENDERS
    for name in pair:
        _cost(run[name], SHORT)  # warm-up: imports, compilation caches
    costs: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "loop": []} for name in pair}
    for repeat in range(repeats):
        for name in pair if repeat % 2 == 0 else pair[::-1]:
            short, long = _cost(run[name], SHORT), _cost(run[name], steps)
            costs[name]["wall"].append((long[0] - short[0]) / (steps - SHORT))
            costs[name]["cpu"].append((long[1] - short[1]) / (steps - SHORT))
            if long[2] is not None:
                costs[name]["loop"].append(long[2])
    return costs


def in_subprocess(args: list[str], xla: bool, script: str = __file__, xla_devices: int = 1) -> Any:
    """What ``script args`` prints last (JSON), run in a fresh process (XLA:CPU with ``xla_devices``)."""
    env = {**os.environ}
    if xla:
        env["PJRT_DEVICE"] = "CPU"
        env["CPU_NUM_DEVICES"] = str(xla_devices)
    else:
        env.pop("PJRT_DEVICE", None)
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", choices=sorted(PAIRS), action="append", help="run only these comparisons")
    parser.add_argument("--run", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--pair", choices=sorted(PAIRS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(CONTENDERS[args.run](args.steps)))
        return
    if args.pair:
        print(json.dumps(per_step_costs(PAIRS[args.pair], args.steps, args.repeats)))
        return
    wanted = args.only or list(PAIRS)
    if "lightning" in wanted and importlib.util.find_spec("lightning") is None:
        print("lightning is not installed: no Trainer comparison")
        wanted.remove("lightning")
    print(
        f"tied LM of examples/tied_lm.py, batch {BATCH} per device; per-step cost from runs of {args.steps} - {SHORT}"
    )
    print(f"steps, {args.repeats} alternating repeats; load average before: {os.getloadavg()[0]:.1f}")
    for key in wanted:
        ours, theirs = PAIRS[key]
        costs = in_subprocess(["--pair", key, "--steps", str(args.steps), "--repeats", str(args.repeats)], key == "xla")
        print(f"\n{ours} vs {theirs}")
        print_costs(ours, theirs, costs)
        if key == "xla":  # each in a fresh process, so neither finds the other's graphs cached
            counts = [in_subprocess(["--run", n, "--steps", "8"], True)["compilations"] for n in (ours, theirs)]
            print(f"  compilations in a fresh process: {ours} {counts[0]}, {theirs} {counts[1]}")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


def print_costs(ours: str, theirs: str, costs: dict[str, dict[str, list[float]]]) -> None:
    """The per-step costs of ``ours`` and ``theirs`` and their ratios; "loop" is each run's own
    timing of its steady steps (no process start or set-up in it), in ms per 1,000 samples."""
    for kind in ("cpu", "wall", "loop"):
        a, b = costs[ours].get(kind, []), costs[theirs].get(kind, [])
        if not a or not b:
            continue
        unit = "ms/step" if kind != "loop" else "ms/1k samples"
        pairs = [x / y for x, y in zip(a, b, strict=False)]
        print(
            f"  {kind:4s} {unit}  {ours} {_fmt(a)}  {theirs} {_fmt(b)}  ratio: median "
            f"{statistics.median(a) / statistics.median(b):.3f}x, best {min(a) / min(b):.3f}x, "
            f"median of paired rounds {statistics.median(pairs):.3f}x"
        )


def _fmt(values: list[float]) -> str:
    return "[" + " ".join(f"{1000 * v:.0f}" for v in sorted(values)) + "]"


if __name__ == "__main__":
    main()
