"""One of the 2 gloo processes tests/test_sharding.py starts: every FSDP2 scenario in one run.

    python tests/sharding_worker.py RANK WORLD PORT OUT_DIR

Each scenario's findings (or its error, as text) go into ``OUT_DIR/rank<RANK>.json``; the tests
assert on them. Scenarios run in the same order on every rank, so their collectives pair up.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]

import models  # noqa: E402
from shard_fsdp2 import TiedLM, collective_full_state, train  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import tiekit  # noqa: E402
from tiekit.backends.torch_distributed import collective_close_process_group  # noqa: E402
from tiekit.plan import CrossModuleUse  # noqa: E402
from tiekit.sharding import shard_units  # noqa: E402
from tiekit.slots import resolve  # noqa: E402

RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])


def differences(state: dict[str, torch.Tensor], reference: nn.Module) -> dict[str, float]:
    """Largest absolute difference from ``reference`` per weight."""
    return {k: (state[k] - v).abs().max().item() for k, v in reference.state_dict().items()}


def reference_lm() -> nn.Module:
    torch.manual_seed(0)
    model = TiedLM()
    train(model)  # one process, whole batches
    return model


def lm_through_shard(units: list[str] | None) -> dict[str, Any]:
    """TiedLM through tiekit.shard: trains like one process (the tie stays one tensor)."""
    torch.manual_seed(0)
    model = TiedLM()
    plan = tiekit.find_ties(model)
    labels = [u.label for u in shard_units(model, units, plan=plan)]
    tiekit.shard(model, units=units)
    tied = model.head.weight is model.embed.weight
    count = len(list(model.parameters()))
    tiekit.check_sharding(model, plan)
    tiekit.check_sharding(model)
    losses = train(model, RANK, WORLD)
    return {
        "units": labels,
        "tied": tied,
        "dtensor": isinstance(model.embed.weight, DTensor),
        "parameters": count,
        "plan_unique": plan.unique_count,
        "tied_after": model.head.weight is model.embed.weight,
        "losses": losses,
        "differences": differences(collective_full_state(model), REFERENCE),
    }


def lm_split() -> dict[str, Any]:
    """The tie split across units by hand: check_sharding refuses it; training it anyway."""
    torch.manual_seed(0)
    model = TiedLM()
    plan = tiekit.find_ties(model)
    fully_shard(model.embed)
    fully_shard(model.head)
    fully_shard(model)
    out: dict[str, Any] = {"parameters": len(list(model.parameters()))}
    for key, kwargs in (("check_with_plan", {"plan": plan}), ("check_without_plan", {})):
        try:
            tiekit.check_sharding(model, **kwargs)
            out[key] = None
        except tiekit.TieError as exc:
            out[key] = str(exc)
    try:
        train(model, RANK, WORLD)
    except Exception as exc:  # noqa: BLE001 - torch 2.13+ refuses split units at the first forward
        out["training_error"] = f"{type(exc).__name__}: {exc}"
    else:
        out["differences"] = differences(collective_full_state(model), REFERENCE)
    return out


def read_in_root(traced: bool) -> dict[str, Any]:
    """A model whose root reads the embedding matrix in its own forward, with the embedding asked
    for as a unit: through a plan from find_ties(trace=True) tiekit.shard sends that unit back to the
    root and it trains like one process; without the trace it is a unit of its own."""
    torch.manual_seed(0)
    reference = models.FunctionalHeadLM()
    train(reference)
    torch.manual_seed(0)
    model = models.FunctionalHeadLM()
    plan = tiekit.find_ties(model, trace=traced)
    units = ["embed", "blocks.*"]
    out: dict[str, Any] = {"units": [u.label for u in shard_units(model, units, plan=plan)]}
    tiekit.shard(model, units=units, plan=plan)
    traced_plan = plan if traced else tiekit.find_ties(models.FunctionalHeadLM(), trace=True)
    try:
        tiekit.check_sharding(model, traced_plan)
        out["check"] = None
    except tiekit.TieError as exc:
        out["check"] = str(exc)
    try:
        train(model, RANK, WORLD)
    except Exception as exc:  # noqa: BLE001 - the failure is what the control shows
        out["training_error"] = f"{type(exc).__name__}: {exc}"
    else:
        out["differences"] = differences(collective_full_state(model), reference)
    return out


def no_waiting() -> dict[str, Any]:
    """shard and check_sharding on rank 0 while rank 1 has not started: neither waits for it."""
    flag = OUT / "rank0-wrapped"
    if RANK == 1:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    start = time.monotonic()
    torch.manual_seed(0)
    model = tiekit.shard(TiedLM())
    tiekit.check_sharding(model)
    seconds = time.monotonic() - start
    if RANK == 0:
        flag.write_text("done")
    return {"seconds": seconds, "saw_rank0_first": flag.exists()}


def hf_model(factory: Callable[[], nn.Module], **shard_kwargs: Any) -> dict[str, Any]:
    """An HF model from a small config through tiekit.shard: ties kept, one step, the check passes."""
    torch.manual_seed(0)
    model = factory()
    plan = tiekit.find_ties(model)
    tiekit.shard(model, **shard_kwargs)
    tiekit.check_sharding(model, plan)
    tiekit.check_sharding(model)

    def tied() -> list[bool]:
        return [resolve(model, n)[2] is resolve(model, g.source)[2] for g in plan for n in g.names]

    found = {"groups": [list(g.names) for g in plan], "tied": tied(), "parameters": len(list(model.parameters()))}
    found["plan_unique"] = plan.unique_count
    found["dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (2, 8), generator=torch.Generator().manual_seed(RANK))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    found.update(loss=out.loss.item(), logits_dtype=str(out.logits.dtype).removeprefix("torch."))
    found["tied_after_step"] = tied()
    tiekit.check_sharding(model, plan)
    return found


def funnel() -> nn.Module:
    """FunnelForMaskedLM (word embeddings tied to the head): its encoder's blocks are ModuleLists of layers."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    config = FunnelConfig(
        vocab_size=101, block_sizes=[2, 2], num_decoder_layers=2, d_model=16, n_head=2, d_head=8, d_inner=32
    )
    return FunnelForMaskedLM(config)


def init_weights(model: nn.Module) -> None:
    """Every layer's own initialization, on whatever tensors the model holds now."""
    torch.manual_seed(1)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()  # type: ignore[operator]


def meta(order: str) -> dict[str, Any]:
    """Built on the meta device, sharded and materialized in ``order``; the ties afterwards."""
    with torch.device("meta"):
        model = TiedLM()
    plan = tiekit.find_ties(model)
    out: dict[str, Any] = {}
    if order == "shard, preserve_ties(to_empty)":
        tiekit.shard(model)
        with tiekit.preserve_ties(model, plan=plan):
            model.to_empty(device="cpu")
    elif order == "shard, to_empty":
        tiekit.shard(model)
        model.to_empty(device="cpu")
    elif order == "to_empty, fully_shard":  # the usual failure: materialize, then wrap
        model.to_empty(device="cpu")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        try:
            tiekit.check_sharding(model, plan)
            out["check"] = None
        except tiekit.TieError as exc:
            out["check"] = str(exc)
    elif order == "to_empty, shard(plan=)":  # the plan from before to_empty restores the tie
        model.to_empty(device="cpu")
        tiekit.shard(model, plan=plan)
    init_weights(model)
    if order == "shard, preserve_ties(to_empty)":
        tiekit.retie(model, plan)  # init replaced nothing here; retie is the recipe's safety net
    out["tied"] = model.head.weight is model.embed.weight
    out["parameters"] = len(list(model.parameters()))
    out["device"] = str(model.embed.weight.device)
    out["losses"] = train(model, RANK, WORLD, steps=1)
    out["tied_after_step"] = model.head.weight is model.embed.weight
    return out


class ScalarGain(nn.Module):
    """A block with a 0-d parameter, which fully_shard refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.tensor(1.0))


def errors() -> dict[str, Any]:
    """What shard and check_sharding say about bad input, as text."""
    out: dict[str, Any] = {}

    def record(key: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            out[key] = None
        except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
            out[key] = {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", [])}

    torch.manual_seed(0)
    wrapped = tiekit.shard(TiedLM())
    before = list(wrapped.parameters())
    again = tiekit.shard(wrapped)  # Lightning's configure_model, called again for validate
    out["again_same_model"] = again is wrapped and all(
        a is b for a, b in zip(before, wrapped.parameters(), strict=True)
    )
    out["again_tied"] = wrapped.head.weight is wrapped.embed.weight
    record("again_other_options", lambda: tiekit.shard(wrapped, reshard_after_forward=False))
    record("again_other_units", lambda: tiekit.shard(wrapped, units=["blocks.0"]))
    # The same sharding said otherwise: the default units named.
    record("again_equivalent", lambda: tiekit.shard(wrapped, units=["blocks.*"]))
    yours = TiedLM()
    fully_shard(yours)
    record("already_wrapped", lambda: tiekit.shard(yours))
    record("plan_of_another_model", lambda: tiekit.check_sharding(wrapped, tiekit.find_ties(models.gpt2())))
    alien = CrossModuleUse(name="embed.weight", reader="decoder")
    alien_plan = dataclasses.replace(tiekit.find_ties(TiedLM()), cross_module=(alien,))
    record("reader_of_another_model", lambda: tiekit.check_sharding(wrapped, alien_plan))
    record("scalar_parameter", lambda: tiekit.shard(nn.Sequential(ScalarGain(), ScalarGain())))
    views = models.ViewBuffers()
    plan = tiekit.find_ties(views)
    fully_shard(views)
    record("view_buffers", lambda: tiekit.check_sharding(views, plan))
    return out


def main() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=WORLD)
    torch.set_num_threads(1)
    found: dict[str, Any] = {"torch": torch.__version__}
    scenarios: list[tuple[str, Callable[[], Any]]] = [
        ("no_waiting", no_waiting),
        ("lm_default", lambda: lm_through_shard(None)),
        ("lm_units", lambda: lm_through_shard(["embed", "head", "blocks.*"])),
        ("lm_split", lm_split),
        ("read_in_root_traced", lambda: read_in_root(True)),
        ("read_in_root_untraced", lambda: read_in_root(False)),
        ("errors", errors),
        ("gpt2", lambda: hf_model(lambda: models.gpt2(vocab_size=101))),
        (
            "gpt2_bf16",
            lambda: hf_model(
                lambda: models.gpt2(vocab_size=101),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                units=["transformer.h.*", "transformer.wte", "lm_head"],
            ),
        ),
        ("llama", lambda: hf_model(models.llama)),
        ("t5", lambda: hf_model(models.t5)),
        ("funnel", lambda: hf_model(funnel)),  # lists of lists of layers: the default units failed
        *[
            (f"meta: {order}", lambda order=order: meta(order))
            for order in (
                "shard, preserve_ties(to_empty)",
                "shard, to_empty",
                "to_empty, fully_shard",
                "to_empty, shard(plan=)",
            )
        ],
    ]
    try:
        for name, scenario in scenarios:
            try:
                found[name] = scenario()
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                found[name] = {"error": traceback.format_exc()}
    finally:
        (OUT / f"rank{RANK}.json").write_text(json.dumps(found, indent=1))
        collective_close_process_group()  # meet before destroying: gloo can abort at exit without it


REFERENCE = reference_lm()

if __name__ == "__main__":
    main()
