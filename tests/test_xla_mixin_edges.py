"""Mixin and `move` edges on the real XLA runtime: plans kept across other models' registrations,
conversions that fail half way, and optimizer counters through a cast. Each shows the break."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from models import ViewBuffers, WeightSharingModule
from torch import nn

import tiekit

pytestmark = pytest.mark.xla


class MixinViewBuffers(tiekit.TPUMixin, ViewBuffers):
    pass


def views_follow(model: ViewBuffers) -> bool:
    """Whether the buffers are still views of ``w`` (on the CPU: one memory, writes show)."""
    with torch.no_grad():
        model.w.fill_(3.0)
    return all(bool((b == 3).all()) and b.data_ptr() >= model.w.data_ptr() for b in (model.wt, model.ws, model.wv))


def round_trip(model: nn.Module, device: torch.device) -> None:
    model.to(device)
    nn.Linear(2, 2)  # another model's registrations, as a replica thread or a data pipeline makes
    model.to(torch.float64)
    model.to("cpu")


def test_view_ties_survive_modules_built_elsewhere_while_on_xla(xla_device: torch.device) -> None:
    """Any registration anywhere dropped every mixin's plan, and the plan made again on XLA, which
    hides a view's geometry, had no view ties: the buffers came back as copies of ``w``."""
    plain = ViewBuffers()
    round_trip(plain, xla_device)
    assert not views_follow(plain)  # without tiekit: three copies

    model = MixinViewBuffers()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tiekit.TieWarning)
        round_trip(model, xla_device)
    assert model.w.dtype == torch.float64 and views_follow(model)

    model = MixinViewBuffers().to(xla_device)
    nn.Linear(2, 2)
    state = {k: v.detach().cpu() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert views_follow(model)


def test_replica_threads_moving_their_own_models_keep_their_views(xla_device: torch.device) -> None:
    """torch_xla.launch's replicas are threads of one process: each one's models registered, so
    each dropped the others' plans (the "mixin thread race")."""
    failures: list[str] = []

    def replica(k: int) -> None:
        try:
            model = MixinViewBuffers()
            for _ in range(3):
                round_trip(model, xla_device)
            if not views_follow(model):
                failures.append(f"replica {k}: the buffers are no longer views of w")
        except Exception as exc:  # noqa: BLE001 - reported below, with the replica
            failures.append(f"replica {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    assert not failures, failures


class MixinWithMetaBuffer(tiekit.TPUMixin, WeightSharingModule):
    """A buffer left on meta after the tied layers: a move to a device fails when it reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Module()
        self.late.register_buffer("stats", torch.empty(3, device="meta"))


def with_meta_buffer(model: nn.Module) -> nn.Module:
    model.late = nn.Module()
    model.late.register_buffer("stats", torch.empty(3, device="meta"))
    return model


def test_a_move_failing_half_way_leaves_the_ties_whole(xla_device: torch.device) -> None:
    """The tied layers moved and the later buffer failed: layer_3 kept the old CPU weight, two
    parameters, and the mixin's next move planned them as two for good."""
    plain = with_meta_buffer(WeightSharingModule())
    with pytest.raises(NotImplementedError):
        plain.to(xla_device)
    assert plain.layer_1.weight is not plain.layer_3.weight  # without tiekit: split

    model = MixinWithMetaBuffer()
    with pytest.raises(NotImplementedError):  # torch's own error: the conversion is torch's
        model.to(xla_device)
    assert model.layer_1.weight is model.layer_3.weight and len(list(model.parameters())) == 2
    model.late.stats = torch.zeros(3)
    model.to("cpu")
    assert model.layer_1.weight is model.layer_3.weight and len(list(model.parameters())) == 2

    moved = with_meta_buffer(WeightSharingModule())
    with pytest.raises(tiekit.TieError, match=r"tiekit.move: converting the model failed \(NotImplemented"):
        tiekit.move(moved, "xla")
    assert moved.layer_1.weight is moved.layer_3.weight

    with pytest.raises(tiekit.TieError, match="'xla:7' is not a device"):  # torch_xla's IndexError before
        tiekit.move(moved, "xla:7")

    preserved = with_meta_buffer(WeightSharingModule())
    with pytest.raises(NotImplementedError), tiekit.preserve_ties(preserved):
        preserved.to(xla_device)
    assert preserved.layer_1.weight is preserved.layer_3.weight


def test_a_cast_keeps_a_capturable_optimizers_step_a_float32_counter(xla_device: torch.device) -> None:
    """`move(model, torch.bfloat16, optimizer=)` cast Adam(capturable=True)'s on-device step to
    bfloat16, where 300 + 1 is 300: its bias correction stopped. torch keeps it float32."""
    import torch_xla

    torch.manual_seed(0)
    model = tiekit.move(WeightSharingModule(), "xla")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(4, 32).to(xla_device)

    def step() -> None:
        model(x).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()

    step()
    for state in optimizer.state.values():
        state["step"].fill_(300.0)
    tiekit.move(model, torch.bfloat16, optimizer=optimizer)
    x = x.to(torch.bfloat16)
    for _ in range(4):
        step()
    steps = [state["step"] for state in optimizer.state.values()]
    assert all(s.dtype == torch.float32 and float(s) == 304.0 for s in steps), steps
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


class ValueEqualLinear(nn.Linear):
    """A module class that compares and hashes by value, as config-keyed modules may."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueEqualLinear) and other.in_features == self.in_features

    def __hash__(self) -> int:
        return hash(("ValueEqualLinear", self.in_features))


class MixinWithValueEqualHead(tiekit.TPUMixin, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.head = ValueEqualLinear(4, 4, bias=False)


def test_a_tie_made_in_a_module_that_hashes_by_value_is_planned(xla_device: torch.device) -> None:
    """The module's registration was kept under a key equal to another module's, and went with that
    one: the kept plan (no ties) was reused, and the tie made since was split by the next move."""
    import gc

    model = MixinWithValueEqualHead()
    model.to(xla_device)
    model.to("cpu")  # the plan (no ties) is kept
    other = ValueEqualLinear(4, 4, bias=False)  # equal to model.head
    model.head.weight = model.a.weight
    del other
    gc.collect()
    model.to(xla_device)
    model.to("cpu")
    assert model.head.weight is model.a.weight and len(list(model.parameters())) == 1
