"""FSDP2 sharding that keeps ties (issue 11): `tiekit.shard` and `tiekit.check_sharding`.

The multi-process scenarios run once, in 2 gloo processes on 127.0.0.1 (tests/sharding_worker.py,
about 10 s), and each test below reads its part of their findings; a hang fails after
`launching.TIMEOUT` seconds. The unit planning needs no process group and is tested here directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from launching import EXAMPLES, ROOT, base_env, describe, free_port, run_ok
from models import FunctionalHeadLM, ViewBuffers, gpt2, t5
from torch import nn

import tiekit
from tiekit.sharding import repeated_blocks, shard_units

NEW_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
SPLIT_REFUSED = "shared with a parameter already managed by another FSDP group"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both processes' findings (rank 0, rank 1)."""
    out = tmp_path_factory.mktemp("sharding")
    port = free_port()
    worker = str(ROOT / "tests" / "sharding_worker.py")
    commands = [[sys.executable, worker, str(rank), "2", str(port), str(out)] for rank in (0, 1)]
    runs = run_ok(commands, env=base_env(), cwd=out)
    found = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    errors = {f"rank {r} {k}": v["error"] for r, f in enumerate(found) for k, v in f.items() if "error" in v}
    assert not errors, "\n".join(f"--- {k}\n{v}" for k, v in errors.items()) + describe(runs)
    return found


# -- a tied LM (vocabulary 101, 2 processes) against one process -------------------------------


@pytest.mark.parametrize("scenario", ["lm_default", "lm_units"])
def test_shard_trains_like_one_process(ranks: list[dict[str, Any]], scenario: str) -> None:
    for found in ranks:
        run = found[scenario]
        assert run["tied"] and run["tied_after"] and run["dtensor"]
        assert run["parameters"] == run["plan_unique"] == 9  # one tensor for embed.weight and head.weight
        assert max(run["differences"].values()) < 1e-5, run["differences"]
    expected = ["blocks.0", "blocks.1", "<root>"]
    if scenario == "lm_units":  # embed and head asked for apart: joined into one unit
        expected = ["embed + head", *expected]
    assert ranks[0][scenario]["units"] == expected


def test_split_units_are_refused_by_check_sharding_and_train_wrong(ranks: list[dict[str, Any]]) -> None:
    for found in ranks:
        split = found["lm_split"]
        assert split["parameters"] == 10  # embed.weight and head.weight sharded as two tensors
        for key in ("check_with_plan", "check_without_plan"):
            assert "embed.weight (unit 'embed'), head.weight (unit 'head')" in split[key], split[key]
            assert "managed by different units; one unit for: embed, head" in split[key]
        if NEW_TORCH:
            assert SPLIT_REFUSED in split["training_error"]
        else:  # accepted silently, and training drifts from the reference
            assert "training_error" not in split, split["training_error"]
            assert split["differences"]["embed.weight"] > 1e-2
            assert split["differences"]["head.weight"] > 1e-2


def test_a_weight_the_root_reads_in_forward_goes_back_to_the_root_with_a_traced_plan(
    ranks: list[dict[str, Any]],
) -> None:
    """FunctionalHeadLM's root computes its logits from embed.weight. With the embedding a unit of
    its own, FSDP2 gathers that weight only around the embedding's forward and the root's read
    fails (the control, the plan without a trace); find_ties(trace=True) records the read and
    tiekit.shard keeps the embedding with the root: trains like one process."""
    for found in ranks:
        traced, untraced = found["read_in_root_traced"], found["read_in_root_untraced"]
        assert traced["units"] == ["blocks.0", "blocks.1", "<root>"]
        assert max(traced["differences"].values()) < 1e-5, traced["differences"]
        assert untraced["units"] == ["embed", "blocks.0", "blocks.1", "<root>"]
        assert "mixed torch.Tensor and DTensor" in untraced["training_error"]
        # check_sharding with a traced plan says so before the first step; the right units pass.
        assert traced["check"] is None
        assert "embed.weight (unit 'embed') is read by the forward of <root>, outside" in untraced["check"]
        assert "plan=tiekit.find_ties(model, trace=True)" in untraced["check"]


def test_shard_and_check_sharding_do_not_wait_for_other_ranks(ranks: list[dict[str, Any]]) -> None:
    # Rank 1 starts only once rank 0 has wrapped and checked: waiting for it would have hung.
    assert ranks[1]["no_waiting"]["saw_rank0_first"]
    assert ranks[0]["no_waiting"]["seconds"] < 60


# -- Hugging Face models ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "gpt2_bf16", "llama", "t5", "funnel"])
def test_hf_models_keep_their_ties_and_step(ranks: list[dict[str, Any]], name: str) -> None:
    for found in ranks:
        run = found[name]
        assert run["groups"] and all(run["tied"]) and all(run["tied_after_step"])
        assert run["parameters"] == run["plan_unique"] and run["dtensors"]
        assert 0 < run["loss"] < 20
        assert run["logits_dtype"] == ("bfloat16" if name == "gpt2_bf16" else "float32")


# -- the meta device ----------------------------------------------------------------------------


def test_meta_build_shard_then_materialize_keeps_ties(ranks: list[dict[str, Any]]) -> None:
    for found in ranks:
        for order in ("shard, preserve_ties(to_empty)", "to_empty, shard(plan=)"):
            run = found[f"meta: {order}"]
            assert run["tied"] and run["tied_after_step"] and run["parameters"] == 9, (order, run)
            assert run["device"] == "cpu"
        # Measured on torch 2.9.1 and 2.14.1: to_empty after fully_shard swaps the DTensor
        # parameters in place (swap_tensors), so even a plain to_empty keeps them (docs/sharding.md).
        assert found["meta: shard, to_empty"]["tied"]


def test_meta_materialized_before_wrapping_loses_the_tie_without_tiekit(ranks: list[dict[str, Any]]) -> None:
    for found in ranks:
        run = found["meta: to_empty, fully_shard"]
        assert not run["tied"] and run["parameters"] == 10  # no torch error, even on 2.13+
        assert "embed.weight, head.weight were tied but are separate tensors in unit '<root>'" in run["check"]
        assert "tiekit.shard(model, plan=plan), which re-ties first" in run["check"]


# -- errors that need a process group -----------------------------------------------------------


def test_errors_name_the_modules(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    assert errors["already_wrapped"]["type"] == "TiekitError"
    assert (
        "but FSDP is already applied to <root>; to check a model you wrapped yourself"
        in (errors["already_wrapped"]["message"])
    )
    assert errors["again_equivalent"] is None
    for key, shown in [
        ("again_other_options", "options={'reshard_after_forward': False})"),
        ("again_other_units", "units=['blocks.0', '<root>'], options={})"),
    ]:
        assert errors[key]["type"] == "TiekitError", key
        message = errors[key]["message"]
        assert "tiekit.shard already sharded this model with other arguments" in message, message
        assert shown in message, message

    assert errors["plan_of_another_model"]["type"] == "TieError"
    assert "'transformer.wte.weight': no module at 'transformer.wte'" in errors["plan_of_another_model"]["message"]
    reader = errors["reader_of_another_model"]
    assert reader["type"] == "TieError"
    assert "tie plan reader 'decoder' of 'embed.weight': no such module in FSDPTiedLM" in reader["message"]
    scalar = errors["scalar_parameter"]  # torch's own error, with the unit it came from
    assert scalar["type"] == "ValueError" and "scalar" in scalar["message"]
    assert scalar["notes"] == ["tiekit.shard: while sharding the unit '0'"]
    views = errors["view_buffers"]
    assert views["type"] == "TieError"
    assert "wt is a view of w, which FSDP replaced with a sharded tensor" in views["message"]


def test_a_second_shard_with_the_same_arguments_leaves_the_model_as_it_is(ranks: list[dict[str, Any]]) -> None:
    # Lightning calls configure_model once per stage: fit, then validate on the same module.
    assert ranks[0]["errors"]["again_same_model"] is True
    assert ranks[0]["errors"]["again_tied"] is True


def test_shard_without_a_process_group_says_so() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("another test left a process group in this process")
    with pytest.raises(tiekit.TiekitError, match=r"needs a process group: call torch.distributed.init_process_group"):
        tiekit.shard(gpt2())


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinning works where there is an accelerator")
def test_cpu_offload_pinning_memory_without_an_accelerator_is_refused_before_anything_changes() -> None:
    """CPUOffloadPolicy() pins host memory by default: torch failed inside the first fully_shard
    ("Found no NVIDIA driver"), the model left partly wrapped (probe). Refused first, no process
    group needed; pin_memory=False is what the message says to pass."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = gpt2()
    before = list(model.parameters())
    with pytest.raises(tiekit.TiekitError, match=r"pass CPUOffloadPolicy\(pin_memory=False\)"):
        tiekit.shard(model, offload_policy=CPUOffloadPolicy())
    assert all(a is b for a, b in zip(before, model.parameters(), strict=True))
    assert model.lm_head.weight is model.transformer.wte.weight


# -- the example --------------------------------------------------------------------------------


def test_example_runs() -> None:
    runs = run_ok([[sys.executable, str(EXAMPLES / "shard_fsdp2.py")]], env=base_env(), cwd=EXAMPLES)
    lines = [line for line in runs[0].output.splitlines() if not line.startswith("[Gloo]")]
    text = "\n".join(lines)
    assert "tiekit.shard: head.weight is embed.weight: True" in text
    difference = float(text.split("largest difference from one process: ")[1].split()[0])
    assert difference < 1e-5, text
    assert "split units, check_sharding: embed.weight (unit 'embed'), head.weight (unit 'head')" in text
    if NEW_TORCH:
        assert f"refused them at the first forward: Parameter 'head.weight' is {SPLIT_REFUSED}" in text
    else:
        drift = float(text.split("trained them: largest difference ")[1].split()[0])
        assert drift > 1e-2, text


# -- which units (local, no process group) ------------------------------------------------------


def labels(model: nn.Module, units: list[Any] | None = None) -> list[str]:
    return [u.label for u in shard_units(model, units)]


def test_default_units_are_the_repeated_blocks_and_ties_stay_with_the_root() -> None:
    assert labels(gpt2()) == ["transformer.h.0", "transformer.h.1", "<root>"]
    assert labels(t5()) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "<root>"]
    same = nn.Linear(4, 4)
    shared = nn.Sequential(nn.ModuleList([same, same, nn.Linear(4, 4)]), nn.ReLU())
    assert [type(m).__name__ for m in repeated_blocks(shared)] == ["Linear", "Linear"]  # the shared one once
    assert labels(nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))) == ["<root>"]  # nothing repeats


def test_default_units_inside_lists_of_lists_are_the_layers_not_the_inner_lists() -> None:
    """Funnel's encoder holds a ModuleList of ModuleLists: the inner lists were chosen, and
    fully_shard refused them ("containers that do not implement forward"), a raw ValueError from
    tiekit.shard's defaults (probe, FunnelForMaskedLM)."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    config = FunnelConfig(
        vocab_size=101, block_sizes=[2, 2], num_decoder_layers=2, d_model=16, n_head=2, d_head=8, d_inner=32
    )
    model = FunnelForMaskedLM(config)
    blocks = [f"funnel.encoder.blocks.{b}.{layer}" for b in (0, 1) for layer in (0, 1)]
    assert labels(model) == [*blocks, "funnel.decoder.layers.0", "funnel.decoder.layers.1", "<root>"]
    nested = nn.Sequential(nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]) for _ in range(2)]))
    assert labels(nested) == ["0.0.0", "0.0.1", "0.1.0", "0.1.1", "<root>"]


def test_units_by_pattern_class_and_module_join_tied_owners() -> None:
    model = gpt2()
    both = ["transformer.h.*", "transformer.wte", "lm_head"]
    assert labels(model, both) == ["transformer.wte + lm_head", "transformer.h.0", "transformer.h.1", "<root>"]
    # only one owner named: the other joins it with its own module
    assert labels(model, [model.lm_head]) == ["transformer.wte + lm_head", "<root>"]
    assert labels(model, [nn.Embedding]) == ["transformer.wte + lm_head", "transformer.wpe", "<root>"]
    # nested units: the inner ones are wrapped first
    nested = labels(model, ["transformer", "transformer.h.*"])
    assert nested == ["transformer.h.0", "transformer.h.1", "transformer + lm_head", "<root>"]


def test_a_tie_held_by_the_root_itself_keeps_its_units_with_the_root() -> None:
    class RootTied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
            self.w = self.blocks[1].weight

    assert labels(RootTied()) == ["blocks.0", "blocks.2", "<root>"]


class ReaderHead(nn.Module):
    """Logits from an embedding it holds but does not register as a submodule."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.__dict__["embed"] = embed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.embed.weight)


class ReaderHeadLM(FunctionalHeadLM):
    def __init__(self) -> None:
        super().__init__()
        self.out = ReaderHead(self.embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks[1](self.blocks[0](self.embed(ids))))


def test_traced_reads_of_a_weight_outside_its_module_join_the_reader_to_its_unit() -> None:
    root_reads, module_reads = FunctionalHeadLM(), ReaderHeadLM()
    units = ["embed", "blocks.*"]
    for model in (root_reads, module_reads):
        assert labels(model, units) == ["embed", "blocks.0", "blocks.1", "<root>"]  # no trace: no reads known
    plan = tiekit.find_ties(root_reads, trace=True)
    assert [(c.name, c.reader) for c in plan.cross_module] == [("embed.weight", "")]
    assert [u.label for u in shard_units(root_reads, units, plan=plan)] == ["blocks.0", "blocks.1", "<root>"]
    plan = tiekit.find_ties(module_reads, trace=True)
    assert [(c.name, c.reader) for c in plan.cross_module] == [("embed.weight", "out")]
    joined = ["embed + out", "blocks.0", "blocks.1", "<root>"]
    assert [u.label for u in shard_units(module_reads, units, plan=plan)] == joined
    # A reader in a unit nested inside the owner's runs while the owner's unit is gathered: it
    # keeps its own unit.
    nested = nn.Sequential(module_reads)
    plan = tiekit.find_ties(nested, trace=True)
    assert [u.label for u in shard_units(nested, ["0", "0.out"], plan=plan)] == ["0.out", "0", "<root>"]
    with pytest.raises(
        tiekit.TieError, match=r"tie plan reader 'out' of 'embed\.weight': no such module in FunctionalHeadLM"
    ):
        shard_units(root_reads, units, plan=tiekit.find_ties(module_reads, trace=True))


class Crossed(nn.Module):
    """a.b is tied to c's own weight and c.d to a's: units a.b and c.d cannot be ordered."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Module(), nn.Module()
        self.a.b, self.c.d = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.c.w = self.a.b.weight
        self.a.w = self.c.d.weight


def test_bad_units_raise_naming_the_modules() -> None:
    model = gpt2()
    with pytest.raises(tiekit.TiekitError, match=r"'transformer\.x\.\*' matches no module.*transformer, lm_head"):
        shard_units(model, ["transformer.x.*"])
    with pytest.raises(tiekit.TiekitError, match=r"'transformer.h', a ModuleList.*'transformer.h.\*'"):
        shard_units(model, ["transformer.h"])
    with pytest.raises(tiekit.TiekitError, match=r"class Conv1d matches no module"):
        shard_units(model, [nn.Conv1d])
    with pytest.raises(tiekit.TiekitError, match=r"not a submodule of GPT2LMHeadModel"):
        shard_units(model, [nn.Linear(2, 2)])
    with pytest.raises(tiekit.TiekitError, match=r"must be a list"):
        shard_units(model, "transformer.h.*")  # type: ignore[arg-type]
    with pytest.raises(tiekit.TiekitError, match=r"3 is not a name pattern"):
        shard_units(model, [3])  # type: ignore[list-item]
    with pytest.raises(tiekit.TieError, match=r"cannot order the FSDP units .*: a \+ c\.d; a\.b \+ c\. Tied"):
        shard_units(Crossed(), ["a.b", "c.d"])
    with pytest.raises(tiekit.TieError, match=r"cannot shard wt, ws, wv: view\(s\) of parameter 'w'"):
        shard_units(ViewBuffers())
    with pytest.raises(tiekit.TieError, match=r"plan name 'transformer.wte.weight': no module at 'transformer.wte'"):
        shard_units(t5(), plan=tiekit.find_ties(model))


def test_check_sharding_passes_a_model_without_fsdp() -> None:
    model = gpt2()
    tiekit.check_sharding(model)
    tiekit.check_sharding(model, tiekit.find_ties(model))


def test_sharding_functions_name_an_argument_of_the_wrong_type() -> None:
    """A str for the model, a dict for the plan, a device string for the mesh: AttributeErrors
    from inside (torch's fully_shard for the mesh), naming nothing (probe)."""
    model = gpt2()
    with pytest.raises(tiekit.TieError, match=r"tiekit.check_sharding: expected a torch.nn.Module, got str"):
        tiekit.check_sharding("model")  # type: ignore[arg-type]
    with pytest.raises(tiekit.TieError, match=r"tiekit.check_sharding: plan must be a TiePlan .*not a dict"):
        tiekit.check_sharding(model, {})  # type: ignore[arg-type]
    with pytest.raises(tiekit.TieError, match=r"shard_units: expected a torch.nn.Module, got str"):
        shard_units("model")  # type: ignore[arg-type]
    with pytest.raises(tiekit.TieError, match=r"shard_units: plan must be a TiePlan .*not a dict"):
        shard_units(model, plan={})  # type: ignore[arg-type]
    with pytest.raises(tiekit.TiekitError, match=r"tiekit.shard: mesh must be a DeviceMesh .*not 'cpu'"):
        tiekit.shard(model, mesh="cpu")
    assert model.lm_head.weight is model.transformer.wte.weight  # nothing was wrapped


def test_import_tiekit_does_not_load_fsdp() -> None:
    code = "import sys, tiekit; print('torch.distributed.fsdp' in sys.modules, callable(tiekit.shard))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True"]


def test_units_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = gpt2()
    assert labels(model, ["transformer.h.*", "lm_head"]) == [
        "transformer.wte + lm_head",
        "transformer.h.0",
        "transformer.h.1",
        "<root>",
    ]


FORWARD_WRITES = """
import sys, torch, torch.distributed as dist
from torch import nn
import tiekit

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)


class Block(nn.Linear):
    halve = False

    def forward(self, x):
        if self.halve:
            with torch.no_grad():
                self.weight.mul_(0.5)  # its own weight, gathered for this forward
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, root_halves):
        super().__init__()
        self.blocks = nn.ModuleList([Block(8, 8) for _ in range(2)])  # a unit each
        self.head = nn.Linear(8, 8)  # the root's
        self.root_halves = root_halves

    def forward(self, x):
        if self.root_halves:
            with torch.no_grad():
                self.blocks[1].weight.mul_(0.5)  # still sharded here: the write lands in the shard
        return self.head(self.blocks[1](self.blocks[0](x)))


def biggest(p):
    return float(p.full_tensor().abs().max())


x = torch.randn(2, 8)
for case in ("block", "root", "none"):
    torch.manual_seed(0)
    model = tiekit.shard(Net(root_halves=case == "root"))
    model.blocks[1].halve = case == "block"
    before = biggest(model.blocks[1].weight)
    try:
        model(x).sum().backward()
        model(x).sum().backward()  # watched once: the hooks are gone
        print(case, "ran", round(biggest(model.blocks[1].weight) / before, 3), flush=True)
    except tiekit.TiekitError as exc:
        print(case, "refused", str(exc).split(":")[0], flush=True)
"""


def test_shard_refuses_a_first_forward_that_writes_a_gathered_parameter(tmp_path: Any) -> None:
    """A block writing its own (gathered) weight in forward is refused at the first pass; a write
    from outside the unit, to the still-sharded weight, lands in the shard (halved twice over two
    passes) and is not refused; a model writing nothing runs as before."""
    [run] = run_ok([[sys.executable, "-c", FORWARD_WRITES, str(free_port())]], env=base_env(), cwd=tmp_path)
    lines = [line for line in run.output.splitlines() if line.startswith(("block ", "root ", "none "))]
    assert lines == [
        "block refused the forward pass wrote 'blocks.1.weight' in place",
        "root ran 0.25",
        "none ran 1.0",
    ], run.output


TIED_LM = """

class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mid, self.head = nn.Embedding(11, 4), nn.Linear(4, 4), nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))
"""  # the model of the two scripts below

BROKEN_BEFORE_WRAPPING = (
    """
import json, sys, tempfile, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import tiekit

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
"""
    + TIED_LM
    + """

def broken_then_wrapped():
    with torch.device("meta"):
        model = TiedLM()
    model.to_empty(device="cpu")  # without tiekit: the tie breaks here
    for part in (model.embed, model.mid, model.head):
        part.reset_parameters()
    return fully_shard(model)  # FSDP2 takes embed.weight and head.weight as two parameters


def full(t):
    return t.full_tensor().clone()


torch.manual_seed(0)
plan = tiekit.find_ties(TiedLM())
ckpt = tempfile.mkdtemp() + "/ck"
tiekit.save_sharded(TiedLM(), ckpt)
ids = torch.tensor([[1, 2, 3]])
told = {}

by_hand = broken_then_wrapped()  # the control: what a re-tie by attribute would leave
by_hand.head.weight = by_hand.embed.weight
by_hand(ids)
told["by hand, tied after a forward"] = by_hand.head.weight is by_hand.embed.weight

model = broken_then_wrapped()
before = {name: full(p) for name, p in model.named_parameters()}
for call in ("load_sharded", "retie"):
    try:
        tiekit.load_sharded(model, ckpt) if call == "load_sharded" else tiekit.retie(model, plan)
        told[call] = "done"
    except (tiekit.CheckpointError, tiekit.TieError) as exc:
        told[call] = f"{type(exc).__name__}: {exc}"
told["untouched"] = model.head.weight is not model.embed.weight and all(
    torch.equal(full(p), before[name]) for name, p in model.named_parameters()
)

sharded = tiekit.shard(TiedLM())  # re-tied before wrapping: loads, and stays tied through a forward
tiekit.load_sharded(sharded, ckpt)
sharded(ids)
told["tiekit.shard, tied after a forward"] = sharded.head.weight is sharded.embed.weight
del by_hand, model, sharded
tiekit.clear_dtensor_caches()
dist.destroy_process_group()
print(json.dumps(told))
"""
)


def test_a_load_into_a_model_wrapped_after_its_tie_broke_is_refused_not_re_tied_by_attribute(tmp_path: Any) -> None:
    """to_empty broke the tie, then fully_shard took the two names as two parameters. load_sharded
    re-pointed head.weight at embed.weight, `is` held, and FSDP2 put its own (never loaded,
    randomly initialised) head.weight back at the first forward: training went on untied and
    wrong. The control shows a re-tie by attribute not lasting a forward. Now the load and
    `retie` refuse with check_sharding's message, the model untouched."""
    [run] = run_ok([[sys.executable, "-c", BROKEN_BEFORE_WRAPPING, str(free_port())]], env=base_env(), cwd=tmp_path)
    told = json.loads(run.output.strip().splitlines()[-1])
    assert told["by hand, tied after a forward"] is False
    assert told["load_sharded"].startswith("CheckpointError: ")
    for call in ("load_sharded", "retie"):
        assert "embed.weight, head.weight are tied but are separate tensors in unit '<root>'" in told[call], told
        assert "the tie broke before wrapping" in told[call]
    assert told["untouched"] is True
    assert told["tiekit.shard, tied after a forward"] is True


SAVE_OF_SPLIT_TIES = """
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import tiekit

rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, sys.argv[4])
from models import gpt2

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ids = torch.arange(16).remainder(30).view(2, 8)


def split():  # the user's own units: the head apart from the embedding it is tied to
    model = gpt2()
    fully_shard(model.lm_head)
    return fully_shard(model)


told = {}
for case, steps in (("trained", 1), ("new", 0)):
    torch.manual_seed(0)
    model = split()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    except ValueError as exc:  # torch 2.13 and later refuse the split at the first forward
        told[case] = {"torch refused": str(exc)}
        continue
    head, embedding = model.lm_head.weight, model.transformer.wte.weight
    found = {"one tensor": head is embedding, "equal": torch.equal(head.full_tensor(), embedding.full_tensor())}
    try:
        tiekit.save_sharded(model, f"{folder}/{case}", optimizer=optimizer)
        found["saved"] = True
    except tiekit.CheckpointError as exc:
        found["refused"] = str(exc)
    found["written"] = os.path.exists(f"{folder}/{case}")
    told[case] = found
dist.barrier()  # every rank got here: none was left waiting in the save
del model, optimizer
tiekit.clear_dtensor_caches()  # else gloo can abort the process at exit (docs/launching.md)
dist.destroy_process_group()
print(json.dumps(told))
"""


def test_save_sharded_refuses_a_model_whose_fsdp_units_split_a_tie(tmp_path: Any) -> None:
    """GPT-2 with its own fully_shard units splitting the tie, lm_head a unit apart from the
    embedding: torch 2.9 accepts them and trains lm_head.weight and transformer.wte.weight apart
    (the control: two tensors, different after a step). save_sharded wrote them as two tensors
    and no tie, a checkpoint that loads nowhere ("different values, but the model ties them"),
    and before the first step one tensor, as if the model were tied. Now it refuses on both ranks
    with check_sharding's message, before writing anything, as load_sharded refuses to load into
    such a model. torch 2.13 and later refuse the split at the first forward: only the save
    before it is left to refuse there."""
    port = str(free_port())
    tests = str(ROOT / "tests")
    commands = [[sys.executable, "-c", SAVE_OF_SPLIT_TIES, str(r), port, str(tmp_path), tests] for r in (0, 1)]
    runs = run_ok(commands, env=base_env(), cwd=tmp_path)
    for run in runs:
        told = json.loads(run.output.strip().splitlines()[-1])
        if NEW_TORCH:
            assert SPLIT_REFUSED in told.pop("trained")["torch refused"], told
        for case, found in told.items():
            assert found["one tensor"] is False, (case, found)
            assert found["equal"] is (case == "new"), (case, found)  # else trained apart
            refused = found.get("refused", "no error")
            assert refused.startswith(f"{tmp_path / case}: cannot save FSDPGPT2LMHeadModel: "), refused
            assert "tiekit: FSDP would shard and update tied weights as separate tensors" in refused
            listed = "transformer.wte.weight (unit '<root>'), lm_head.weight (unit 'lm_head')"
            assert f"{listed} are tied but are managed by different units" in refused
            assert found["written"] is False
