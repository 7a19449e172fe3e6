"""`tiekit.agreement`'s local parts: what a rank's side of the model comparison holds and how the
differences read (the collective parts run on 2 gloo ranks in tests/test_dcp.py and
tests/test_train_fsdp.py)."""

from __future__ import annotations

import torch
from models import WeightSharingModule
from torch import nn

import tiekit
from tiekit.agreement import digest, disagreement, model_description


def side(model: nn.Module) -> tuple[list[list[str]], dict[str, list[object]]]:
    return model_description(tiekit.find_ties(model), model)


def test_equal_models_have_equal_digests_and_a_broken_tie_changes_it() -> None:
    a, b = WeightSharingModule(), WeightSharingModule()
    assert digest(side(a)) == digest(side(b))
    b.layer_3.weight = nn.Parameter(b.layer_3.weight.detach().clone())
    assert digest(side(a)) != digest(side(b))
    assert disagreement([side(a), side(b)]) == (
        "rank 0 ties layer_1.weight = layer_3.weight, rank 1 does not (moved or loaded without tiekit there?)"
    )


def test_many_differences_are_counted_after_the_first_three() -> None:
    wide = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    wider = nn.Sequential(*[nn.Linear(4, 5) for _ in range(5)])
    told = disagreement([side(wide), side(wider), side(wide)])  # rank 2 agrees: not named
    assert told.count("float32 on rank 1") == 3 and "rank 2" not in told
    assert "key '0.weight' is (5, 4) float32 on rank 1, (4, 4) float32 on rank 0" in told
    assert told.endswith("7 more keys differ in shape or dtype on rank 1")
    fewer = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    assert disagreement([side(wide), side(fewer)]) == "rank 1 holds no '3.weight', '3.bias', '4.weight' and 1 more"


def test_a_lazy_modules_parameters_are_described_without_a_shape() -> None:
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    built = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert side(lazy)[1]["0.weight"] == [None, "float32"]  # no shape until its first forward
    assert "key '0.weight' is (4, 3) float32 on rank 1, (not yet initialized) float32 on rank 0" in disagreement(
        [side(lazy), side(built)]
    )
    lazy(torch.zeros(1, 3))
    assert digest(side(lazy)) == digest(side(built))
