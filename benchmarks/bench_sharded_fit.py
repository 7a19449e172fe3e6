"""Cost of `tiekit.fit`'s sharded strategies against hand-written loops doing the same work (issue 11):

* ``strategy="fsdp"`` on 2 CPU processes (gloo): a step at most 1.05x a hand-written FSDP2 loop
  with the same units (``fully_shard`` on the blocks, then the root);
* ``strategy="spmd_fsdp"`` on 4 XLA:CPU devices: a step at most 1.05x a hand-written SPMD loop
  with the same shardings (every parameter on dimension 0 of an ``"fsdp"`` mesh axis, the batch
  on the same axis) and the same number of compilations;
* for the record: the parameter bytes each rank (or device) holds against the whole model.

Same model, batch and method as ``benchmarks/bench_fit.py`` (the tied LM of ``examples/tied_lm.py``,
batch 16 per device, per-step cost differenced between runs of ``--steps`` and 10 steps,
contenders alternating in one process after a warm-up run each).

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_sharded_fit.py [--repeats 5] [--steps 40]

``--same-process ROUNDS`` compares the fsdp pair inside the same 2 processes instead (fit joins
their process group as it joins torchrun's), each run's in-loop rate, the order flipped every
round: separate processes of the same code differ by a few percent on a small VM.

    .venv/bin/python benchmarks/bench_sharded_fit.py --same-process 10 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from bench_fit import (
    BATCH,
    LOG_EVERY,
    WARMUP,
    adamw,
    hand_loop,
    in_subprocess,
    join_two,
    per_step_costs,
    print_costs,
    spawn_two,
    tied_lm,
)

DEVICES = 4  # XLA:CPU devices of the SPMD contenders


def _local_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's shards, bytes of the whole parameters) of an FSDP2 model."""
    params = list(model.parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in params)  # type: ignore[attr-defined]
    return local, sum(p.numel() * p.element_size() for p in params)


# -- FSDP2 over 2 gloo processes ---------------------------------------------------------------------


def fit_fsdp(steps: int) -> dict[str, Any]:
    import tiekit

    kw = {"strategy": "fsdp", "devices": 2, "max_steps": steps, "batch_size": BATCH, "progress": False}
    result = tiekit.fit(tied_lm.build, tied_lm.corpus(), optimizer=adamw(), **kw)
    return {"samples_per_second": result.samples_per_second}


def _hand_fsdp_rank(rank: int, steps: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tiekit.sharding import shard_units

    join_two(rank, port)
    model = tied_lm.build()
    for unit in shard_units(model)[:-1]:  # the same units as tiekit.shard: the blocks, then the root
        fully_shard(unit.modules if len(unit.modules) > 1 else unit.modules[0])
    fully_shard(model)
    rate = hand_loop(model, rank, steps)
    if rank == 0:
        local, whole = _local_bytes(model)
        Path(out).write_text(json.dumps({"samples_per_second": rate, "local_bytes": local, "whole_bytes": whole}))
    dist.destroy_process_group()


def hand_fsdp(steps: int) -> dict[str, Any]:
    return dict(json.loads(spawn_two(_hand_fsdp_rank, steps)))


def _hand_fsdp_rate(rank: int, steps: int) -> float:
    """The hand FSDP2 loop on a model sharded like tiekit.shard's units, in this process's group."""
    from torch.distributed.fsdp import fully_shard

    from tiekit.sharding import shard_units

    torch.manual_seed(0)
    model = tied_lm.build()
    for unit in shard_units(model)[:-1]:
        fully_shard(unit.modules if len(unit.modules) > 1 else unit.modules[0])
    fully_shard(model)
    return hand_loop(model, rank, steps)


def _same_process_rank(rank: int, steps: int, port: int, out: str) -> None:
    """Both contenders in turn in the same 2 processes, the order flipped every round: fit joins
    this process group as it joins torchrun's, so process start, memory layout and CPU placement
    are the same for both."""
    import torch.distributed as dist

    import tiekit

    rounds = int(os.environ["BENCH_ROUNDS"])
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    join_two(rank, port)
    kw = {"strategy": "fsdp", "max_steps": steps, "batch_size": BATCH, "progress": False}
    found: dict[str, list[float]] = {"fit_fsdp": [], "hand_fsdp": []}
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        for name in ("fit_fsdp", "hand_fsdp") if r % 2 else ("hand_fsdp", "fit_fsdp"):
            if name == "fit_fsdp":
                rate = tiekit.fit(tied_lm.build, tied_lm.corpus(), optimizer=adamw(), **kw).samples_per_second
            else:
                rate = _hand_fsdp_rate(rank, steps)
            if r and rank == 0:  # fit's log, and so its rate, is rank 0's
                found[name].append(1000 / rate)
    if rank == 0:
        Path(out).write_text(json.dumps({name: {"loop": v} for name, v in found.items()}))
    dist.barrier()
    dist.destroy_process_group()


def same_process_costs(steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    os.environ["BENCH_ROUNDS"] = str(rounds)
    return dict(json.loads(spawn_two(_same_process_rank, steps)))


# -- XLA SPMD over 4 XLA:CPU devices -----------------------------------------------------------------


def fit_spmd_fsdp(steps: int) -> dict[str, Any]:
    import tiekit

    kw = {"strategy": "spmd_fsdp", "max_steps": steps, "batch_size": BATCH, "progress": False}
    result = tiekit.fit(tied_lm.build, tied_lm.corpus(), optimizer=adamw(), **kw)
    return {"samples_per_second": result.samples_per_second, "compilations": result.compilations}


def hand_spmd_fsdp(steps: int) -> dict[str, Any]:
    import numpy as np
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch.utils.data import DataLoader, DistributedSampler
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    import tiekit

    xr.use_spmd()
    count = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(count), (count,), ("fsdp",))
    device = torch_xla.device()
    torch.manual_seed(0)
    model = tied_lm.build()
    tiekit.move(model, device)  # a plain .to() would break the tie and shard two copies: keep the work equal
    params = list(model.parameters())
    for p in params:
        xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
    optimizer = adamw()(params)
    data = tied_lm.corpus()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    batches = DataLoader(data, batch_size=BATCH * count, sampler=sampler, drop_last=True)
    loader = MpDeviceLoader(batches, device, input_sharding=xs.ShardingSpec(mesh, ("fsdp", None)))
    losses: list[torch.Tensor] = []
    started = 0.0
    for step, (ids, targets) in enumerate(loader, start=1):
        loss = model(ids, targets)
        loss.backward()
        optimizer.step()
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
    local = sum(torch_xla._XLAC._get_local_shards([p])[0][0][0].nbytes for p in params)
    return {
        "samples_per_second": (steps - WARMUP) * BATCH * count / seconds,
        "compilations": met.metric_data("CompileTime")[0],
        "local_bytes": local,
        "whole_bytes": sum(p.numel() * p.element_size() for p in params),
    }


CONTENDERS = {f.__name__: f for f in (fit_fsdp, hand_fsdp, fit_spmd_fsdp, hand_spmd_fsdp)}
PAIRS = {"fsdp": ("fit_fsdp", "hand_fsdp"), "spmd_fsdp": ("fit_spmd_fsdp", "hand_spmd_fsdp")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=sorted(PAIRS), action="append", help="run only these comparisons")
    parser.add_argument(
        "--same-process",
        type=int,
        metavar="ROUNDS",
        help="fsdp only: fit and the hand loop in turn inside the same 2 processes, in-loop rates",
    )
    parser.add_argument("--run", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--pair", choices=sorted(PAIRS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(CONTENDERS[args.run](args.steps)))
        return
    if args.pair:
        print(json.dumps(per_step_costs(PAIRS[args.pair], args.steps, args.repeats, CONTENDERS)))
        return
    if args.same_process:
        print(f"fit_fsdp vs hand_fsdp in the same 2 processes, {args.same_process} rounds of {args.steps} steps")
        print(f"load average before: {os.getloadavg()[0]:.1f}")
        print_costs("fit_fsdp", "hand_fsdp", same_process_costs(args.steps, args.same_process))
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        return
    print(f"tied LM of examples/tied_lm.py, batch {BATCH} per device; per-step cost from runs of {args.steps} - 10")
    print(f"steps, {args.repeats} alternating repeats; load average before: {os.getloadavg()[0]:.1f}")
    for key in args.only or list(PAIRS):
        ours, theirs = PAIRS[key]
        xla = key == "spmd_fsdp"
        run_args = ["--pair", key, "--steps", str(args.steps), "--repeats", str(args.repeats)]
        costs = in_subprocess(run_args, xla, __file__, DEVICES)
        print(f"\n{ours} vs {theirs}")
        print_costs(ours, theirs, costs)
        # Fresh processes: neither finds the other's graphs cached; the hand loop reports the memory.
        found = [in_subprocess(["--run", n, "--steps", "8"], xla, __file__, DEVICES) for n in (ours, theirs)]
        if xla:
            counts = [f["compilations"] for f in found]
            print(f"  compilations in a fresh process: {ours} {counts[0]}, {theirs} {counts[1]}")
        local, whole = found[1]["local_bytes"], found[1]["whole_bytes"]
        where = f"device 0 of {DEVICES}" if xla else "rank 0 of 2"
        print(f"  parameter bytes on {where}: {local / 2**20:.2f} MiB of {whole / 2**20:.2f} MiB ({local / whole:.3f})")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
