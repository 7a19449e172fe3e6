"""strategy="spmd_fsdp" (issue 11): XLA SPMD with every parameter sharded on an "fsdp" mesh axis, on
4 XLA:CPU devices in a fresh process: it trains like strategy="spmd" on the same global batch,
each tie group is one parameter with one sharding and one device buffer, and each device holds
about a quarter of the weights. A plain ``.to`` before the same sharding is the control."""

from __future__ import annotations

import pytest
from test_train_xla import run_script

pytestmark = pytest.mark.xla

JOB = """
import functools, json, torch, torch_xla
import tiekit
from tiekit import devices
from tiekit.backends.xla_spmd import SpmdBackend, shard_parameters
from models import gpt2, llama, t5
from test_train_fsdp import Tokens

VOCAB = 101  # not a multiple of the 4 devices: the tied embedding's shards are uneven

def build():
    return gpt2(vocab_size=VOCAB)

kw = dict(max_steps=4, seed=1, batch_size=2, progress=False, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
sharded = tiekit.fit(build, Tokens(vocab=VOCAB), strategy="spmd_fsdp", devices=4, **kw)
replicated = tiekit.fit(build, Tokens(vocab=VOCAB), strategy="spmd", devices="auto", **kw)
refused = {}
for strategy, count in (("spmd", 3), ("spmd_fsdp", 8)):
    try:
        tiekit.fit(build, Tokens(vocab=VOCAB), strategy=strategy, devices=count, **kw)
    except tiekit.TiekitError as exc:
        refused[strategy] = str(exc)

others = {}
for other in (llama, t5):
    run = tiekit.fit(other, Tokens(), strategy="spmd_fsdp", **kw)
    groups = lambda m: [[x.name for x in g.members] for g in tiekit.find_ties(m).groups]
    others[other.__name__] = [run.ties_kept, groups(run.model) == groups(other()) != [], run.losses[-1] < run.losses[0]]

def weights(model):
    return {k: v for k, v in model.state_dict().items()}

import tempfile, pathlib
folder = pathlib.Path(tempfile.mkdtemp())
saving = tiekit.fit(build, Tokens(vocab=VOCAB), strategy="spmd_fsdp", checkpoint_dir=folder, checkpoint_every=2, **kw)
resumed = tiekit.fit(build, Tokens(vocab=VOCAB), strategy="spmd_fsdp", resume=folder / "step-00000002", **kw)
resume_diff = max((a - weights(saving.model)[k]).abs().max().item() for k, a in weights(resumed.model).items())
plain_loaded = build()
plain_loaded.lm_head.weight = torch.nn.Parameter(plain_loaded.lm_head.weight.detach().clone())
tiekit.load_sharded(plain_loaded, folder / "step-00000004")
load_diff = max((a - weights(saving.model)[k]).abs().max().item() for k, a in weights(plain_loaded).items())
checkpoints = dict(
    names=sorted(p.name for p in folder.iterdir()), resume_diff=resume_diff, load_diff=load_diff,
    resumed_losses=list(resumed.losses), saving_losses=list(saving.losses),
    plain_tied=plain_loaded.lm_head.weight is plain_loaded.transformer.wte.weight,
)

diff = max((a - weights(replicated.model)[k]).abs().max().item() for k, a in weights(sharded.model).items())

def per_device(params):
    # Bytes of every parameter's shard on device 0 (padding included), and of the whole parameters.
    local = sum(torch_xla._XLAC._get_local_shards([p])[0][0][0].nbytes for p in params)
    return local, sum(p.numel() * p.element_size() for p in params)

backend = SpmdBackend(shard_parameters=True)
torch.manual_seed(0)
model = build()
unique_before = len(list(model.parameters()))
backend.place(model, None, tiekit.find_ties(model))
wte, head = model.transformer.wte.weight, model.lm_head.weight
params = list(model.parameters())
local, whole = per_device(params)
specs = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in (wte, head)]

plain = build().to(backend.device)  # the control: the move breaks the tie before the sharding
annotated_plain = shard_parameters(plain, backend.mesh)
plain_local, _ = per_device(list(plain.parameters()))

import numpy as np
import torch_xla.distributed.spmd as xs

def refusal(model, mesh):
    try:
        shard_parameters(model, mesh)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

half = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
tiekit.move(half[0], backend.device)  # the second layer left on the CPU
moved = tiekit.move(torch.nn.Linear(8, 8), backend.device)
shard_refusals = dict(
    cpu=[refusal(half, backend.mesh), torch_xla._XLAC._get_xla_sharding_spec(half[0].weight)],
    mesh_2d=[refusal(moved, xs.Mesh(np.arange(4), (2, 2), ("data", "fsdp"))),
             torch_xla._XLAC._get_xla_sharding_spec(moved.weight)],
)

# A run that fails after it placed the module passed to fit puts it back on the CPU, tied and unchanged.
from models import WeightSharingModule
from torch.utils.data import TensorDataset

def bad_loss(out, y):
    raise ValueError("a bug in loss_fn")

untied = WeightSharingModule()
untied.layer_3.weight = torch.nn.Parameter(untied.layer_3.weight.detach() + 1.0)
tiekit.save_sharded(untied, folder / "untied")
g = torch.Generator().manual_seed(0)
tiny = TensorDataset(torch.randn(8, 32, generator=g), torch.randn(8, 10, generator=g))
failed_fits = {}
for name, strategy, extra in (
    ("optimizer", "spmd_fsdp", dict(optimizer=lambda params: None)),
    ("missing", "spmd_fsdp", dict(resume=folder / "missing")),
    ("untied", "spmd_fsdp", dict(resume=folder / "untied")),
    ("loss_fn", "spmd_fsdp", dict(loss_fn=bad_loss)),
    ("spmd", "spmd", dict(optimizer=lambda params: None)),
):
    model = WeightSharingModule().eval()
    before, first = {k: v.clone() for k, v in model.state_dict().items()}, model.layer_1.weight
    try:
        tiekit.fit(model, tiny, **{**dict(loss_fn=torch.nn.functional.mse_loss, max_steps=1, batch_size=2,
                                         progress=False, strategy=strategy), **extra})
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    try:
        model(torch.randn(2, 32))
        forward = "ok"
    except Exception as exc:
        forward = f"{type(exc).__name__}: {exc}"[:200]
    w = model.layer_1.weight
    failed_fits[name] = dict(error=error, device=str(w.device), tied=model.layer_3.weight is w,
                             unchanged=unchanged, training=model.training, forward=forward, same=w is first)

print(json.dumps(dict(
    strategies=[sharded.strategy, replicated.strategy], worlds=[sharded.world_size, replicated.world_size],
    losses=[list(sharded.losses), list(replicated.losses)], max_diff=diff, ties_kept=sharded.ties_kept,
    returned_tied=sharded.model.lm_head.weight is sharded.model.transformer.wte.weight,
    compilations=[sharded.compilations, replicated.compilations], refused=refused, others=others,
    tied=head is wte, specs=specs, handles=len(set(devices.xla_buffer_handles([wte, head]))),
    unique=[unique_before, len(params)], local=local, whole=whole,
    checkpoints=checkpoints, plain=[annotated_plain, plain.lm_head.weight is plain.transformer.wte.weight, plain_local],
    shard_refusals=shard_refusals, failed_fits=failed_fits,
)))
"""


@pytest.fixture(scope="module")
def out() -> dict[str, object]:
    return run_script(JOB, devices=4)


def test_spmd_fsdp_trains_like_spmd_on_the_same_global_batch(out: dict[str, object]) -> None:
    assert out["strategies"] == ["spmd_fsdp", "spmd"] and out["worlds"] == [4, 4]
    sharded, replicated = out["losses"]  # type: ignore[misc]
    assert sharded == pytest.approx(replicated, rel=1e-4, abs=1e-5)
    assert sharded[-1] < sharded[0]
    assert out["max_diff"] < 1e-4  # type: ignore[operator]
    assert out["ties_kept"] and out["returned_tied"]
    print("compilations (spmd_fsdp, spmd):", out["compilations"])


def test_each_tie_group_is_one_parameter_with_one_sharding_and_one_buffer(out: dict[str, object]) -> None:
    assert out["tied"] and out["handles"] == 1
    wte, head = out["specs"]  # type: ignore[misc]
    assert wte == head and "devices=[4,1]" in wte  # rows split over the 4 devices of the "fsdp" axis
    before, after = out["unique"]  # type: ignore[misc]
    assert before == after
    # The control: a plain move makes the tie two parameters, each sharded (and stored) on its own.
    annotated, tied, plain_local = out["plain"]  # type: ignore[misc]
    assert annotated == after + 1 and not tied and plain_local > out["local"]  # type: ignore[operator]


def test_each_device_holds_about_a_quarter_of_the_weights(out: dict[str, object]) -> None:
    ratio = out["local"] / out["whole"]  # type: ignore[operator]
    assert 0.24 < ratio < 0.27, ratio  # uneven shards round up: 26 of 101 rows on device 0


def test_spmd_strategies_take_the_device_count_or_auto(out: dict[str, object]) -> None:
    refused = out["refused"]
    assert set(refused) == {"spmd", "spmd_fsdp"}  # type: ignore[arg-type]
    assert "there are 4, not devices=3" in refused["spmd"]  # type: ignore[index]
    assert "there are 4, not devices=8" in refused["spmd_fsdp"]  # type: ignore[index]


def test_llama_and_t5_keep_their_ties_under_spmd_fsdp(out: dict[str, object]) -> None:
    assert out["others"] == {"llama": [True, True, True], "t5": [True, True, True]}


def test_spmd_fsdp_checkpoints_resume_and_load_into_a_plain_model(out: dict[str, object]) -> None:
    saved = out["checkpoints"]
    assert isinstance(saved, dict)
    assert saved["names"] == ["step-00000002", "step-00000004"]
    assert saved["resumed_losses"] == pytest.approx(saved["saving_losses"][2:], rel=1e-5, abs=1e-6)
    assert saved["resume_diff"] < 1e-5  # resumed from step 2: the same weights at step 4
    assert saved["plain_tied"] and saved["load_diff"] == 0.0  # the broken tie restored, values equal


def test_shard_parameters_refuses_a_parameter_off_the_device_and_a_2d_mesh_before_annotating(
    out: dict[str, object],
) -> None:
    refusals = out["shard_refusals"]
    assert isinstance(refusals, dict)
    error, spec = refusals["cpu"]
    assert error.startswith("TiekitError: shard_parameters: parameter '1.weight' is on cpu"), error
    assert spec == ""  # the parameter before it was not annotated either: the model is as it was
    error, spec = refusals["mesh_2d"]
    assert error.startswith("TiekitError: shard_parameters shards over a 1-D mesh, and this mesh has 2 axes"), error
    assert spec == ""


def test_a_failed_spmd_fit_leaves_the_module_passed_on_the_cpu_tied_and_unchanged(out: dict[str, object]) -> None:
    """It was left sharded on the XLA device, where a CPU forward failed ("Expected XLA tensor")."""
    fits = out["failed_fits"]
    assert isinstance(fits, dict)
    expected = {
        "optimizer": "TiekitError: the optimizer factory",
        "missing": "TiekitError: resume: no checkpoint at",
        "untied": "CheckpointError: ",  # the checkpoint's two tensors differ, and the model ties them
        "loss_fn": "ValueError: a bug in loss_fn",
        "spmd": "TiekitError: the optimizer factory",
    }
    for name, start in expected.items():
        fit = fits[name]
        assert fit["error"].startswith(start), (name, fit["error"])
        put_back = {"device": "cpu", "tied": True, "unchanged": True, "training": False, "forward": "ok"}
        assert fit == {**fit, **put_back}, name
    assert "different values" in fits["untied"]["error"]
    # A resume= path nobody can open stops the run before the move: the very same parameters.
    assert fits["missing"]["same"] and not fits["optimizer"]["same"]
