"""The processes tests/test_dcp.py starts: sharded checkpoints saved by 2 gloo ranks, loaded on 1, 2, 4.

    python tests/dcp_worker.py save RANK WORLD PORT OUT_DIR
    python tests/dcp_worker.py load RANK WORLD PORT OUT_DIR      (WORLD 1: a plain process, no group)

Each scenario's findings (or its error, as text) go into ``OUT_DIR/<mode>-<WORLD>-rank<RANK>.json``;
the tests assert on them. Scenarios run in the same order on every rank, so collectives pair up.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import shard_fsdp2  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

import tiekit  # noqa: E402
from tiekit.backends.torch_distributed import collective_close_process_group  # noqa: E402

warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
VOCAB, DIM = 4001, 128  # the embedding dominates the bytes; 4001 rows divide by neither 2 nor 4


def tied_lm() -> nn.Module:
    """examples/shard_fsdp2.py's tied LM, with an embedding that dominates the bytes."""
    return shard_fsdp2.TiedLM(VOCAB, DIM)


def batch(step: int) -> torch.Tensor:
    """Global batch ``step``: 4 sequences of 9 tokens, the same in every process."""
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(100 + step))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, index: int, rank: int, world: int) -> float:
    """One AdamW step on this rank's equal share of global batch ``index`` (the mean over equal
    shares is the whole batch's mean: the same step on 1, 2 or 4 ranks)."""
    ids = batch(index).chunk(world)[rank]
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, by every name (DTensors gathered: collective when sharded)."""
    inner = getattr(model, "module", model)
    out = {}
    for k, v in inner.state_dict().items():
        if type(v).__name__ == "DTensor":
            v = v.full_tensor()
        out[k] = v.detach().clone()
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """exp_avg and exp_avg_sq whole, by parameter name (collective when sharded)."""
    inner = getattr(model, "module", model)
    out = {}
    for name, p in inner.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[p][key]
            out[f"{name}/{key}"] = (value.full_tensor() if type(value).__name__ == "DTensor" else value).clone()
    return out


def save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, os.fspath(path))


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def metadata_summary(folder: Path) -> list[str]:
    """Every item DCP's ``.metadata`` in ``folder`` describes (its storage, its tensor metadata),
    its storage meta and version left out (they name the save), sorted, as text."""
    metadata = FileSystemReader(folder).read_metadata()
    stored = [f"{index} -> {info}" for index, info in metadata.storage_data.items()]
    described = [f"{name}: {meta}" for name, meta in metadata.state_dict_metadata.items()]
    return sorted(stored) + sorted(described) + [repr(metadata.planner_data)]


def fsdp_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiekit.shard(tied_lm()) if WORLD > 1 else tied_lm()


def save_scenarios() -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    def fsdp() -> dict[str, Any]:
        """FSDP2 via tiekit.shard: 2 steps, save_sharded with optimizer; the step after it is the reference."""
        import torch.distributed.checkpoint as dcp

        model = fsdp_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(2):
            step(model, optimizer, i, RANK, WORLD)
        tiekit.save_sharded(model, OUT / "fsdp", optimizer=optimizer, extra={"step": 2, "note": "fsdp"})
        # The bytes: tiekit's save of the weights, and a plain DCP save of the same state (the control).
        tiekit.save_sharded(model, OUT / "fsdp-weights")
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(OUT / "plain-dcp"))
        saved, saved_optimizer = full_state(model), full_optimizer_state(model, optimizer)
        loss = step(model, optimizer, 2, RANK, WORLD)
        after = full_state(model)
        if RANK == 0:
            save_tensors(saved, OUT / "fsdp-saved.safetensors")
            save_tensors(saved_optimizer, OUT / "fsdp-saved-optimizer.safetensors")
            save_tensors(after, OUT / "fsdp-after-step.safetensors")
        return {
            "loss_after": loss,
            "tiekit_bytes": disk_bytes(OUT / "fsdp-weights"),
            "plain_bytes": disk_bytes(OUT / "plain-dcp"),
            "unique_bytes": sum(v.numel() * v.element_size() for k, v in saved.items() if k != "head.weight"),
            "dtensor": type(model.embed.weight).__name__,
            "tied": model.head.weight is model.embed.weight,
        }

    def ddp() -> dict[str, Any]:
        """A DDP-wrapped model: saved through the wrapper under the model's own names."""
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        model = DistributedDataParallel(tied_lm())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 0, RANK, WORLD)
        tiekit.save_sharded(model, OUT / "ddp", optimizer=optimizer)
        if RANK == 0:
            save_tensors(full_state(model), OUT / "ddp-saved.safetensors")
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"bytes": disk_bytes(OUT / "ddp"), "unique_bytes": 3 * weights}  # weights, exp_avg, exp_avg_sq

    def asynchronous() -> dict[str, Any]:
        """blocking=False: training goes on while the files are written; the marker comes last."""
        model = fsdp_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 0, RANK, WORLD)
        first = tiekit.save_sharded(model, OUT / "async", optimizer=optimizer)
        step(model, optimizer, 1, RANK, WORLD)
        saved = full_state(model)
        handle = tiekit.save_sharded(model, OUT / "async", optimizer=optimizer, blocking=False)
        step(model, optimizer, 2, RANK, WORLD)  # training continues meanwhile
        changed = not torch.equal(full_state(model)["embed.weight"], saved["embed.weight"])
        handle.wait(timeout=120)
        # Done on rank 1 means its part is written; rank 0's wait returns once it committed (and
        # removed the previous save folder), so the folder is read after rank 0's wait.
        dist.barrier()
        if RANK == 0:
            save_tensors(saved, OUT / "async-saved.safetensors")
        marker = json.loads((OUT / "async" / tiekit.dcp.MARKER_NAME).read_text())
        return {
            "first_id": first.save_id,
            "second_id": handle.save_id,
            "marker_id": marker["save_id"],
            "done": handle.done(),
            "changed_meanwhile": changed,
            "folders": sorted(p.name for p in (OUT / "async").glob("save-*")),
        }

    def torn_on_rank_1(model: nn.Module, handle: Any, copies: Any) -> str | None:
        """A deferred save whose copy rank 1 tears (a forward pass writing its own sharded
        parameter before the copies settle): its error on this rank, or None if it succeeded."""
        assert copies is not None
        if RANK == 1:
            with torch.no_grad():
                model.embed.weight.mul_(2.0)
        copies.settle()
        try:
            handle.wait(timeout=120)
            torn = None
        except tiekit.CheckpointError as exc:
            torn = str(exc)
        dist.barrier()
        return torn

    def deferred() -> dict[str, Any]:
        """fit's background saves (``defer=True``: parameters and moments copied by the writer,
        beside the next step). A parameter rank 1 writes before its copies settle fails the save on
        both ranks, none left waiting, and the previous save stays; a clean save then holds the
        values of its call although the optimizer step ran before it was written."""
        from tiekit.dcp.saving import save_sharded_staged

        model = fsdp_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 0, RANK, WORLD)
        folder = OUT / "deferred"
        found: dict[str, Any] = {"first": tiekit.save_sharded(model, folder, optimizer=optimizer).save_id}
        handle, staging, copies = save_sharded_staged(model, folder, optimizer=optimizer, blocking=False, defer=True)
        found["torn"] = torn_on_rank_1(model, handle, copies)
        found["marker_after_torn"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
        # fit's way from here on (adopt=True): the moments move into this rank's shard image when
        # the copies settle, and the next save writes them from there.
        for save in ("second", "third"):
            saved = full_state(model) | full_optimizer_state(model, optimizer)
            handle, staging, copies = save_sharded_staged(
                model, folder, optimizer=optimizer, blocking=False, staging=staging, defer=True, adopt=True
            )
            assert copies is not None and staging.image is not None
            moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
            found[f"{save}_lent"] = copies.lent is not None
            found[f"{save}_moments_in_image_at_call"] = [staging.image.holds(m.to_local()) for m in moments]
            ids = batch(5).chunk(WORLD)[RANK]
            F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
            copies.settle()  # fit's train_step: before the optimizer step
            moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
            found[f"{save}_moments_in_image"] = [
                type(m).__name__ == "DTensor" and staging.image.holds(m.to_local()) for m in moments
            ]
            optimizer.step()  # changes the moments in the image the writer may still be writing
            optimizer.zero_grad()
            handle.wait(timeout=120)
            dist.barrier()  # rank 0 committed
            found[save] = handle.save_id
            # The third save's layout is the second's: it is written as DCP planned the second
            # (tiekit.dcp.replay), into the same files at the same offsets, with the same metadata.
            found[f"{save}_recipe"] = None if staging.recipe is None else id(staging.recipe)
            found[f"{save}_metadata"] = metadata_summary(folder / f"save-{handle.save_id}")
            found[f"{save}_marker"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
            fresh = fsdp_model(seed=1)
            fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            tiekit.load_sharded(fresh, folder, optimizer=fresh_optimizer)
            loaded = full_state(fresh) | full_optimizer_state(fresh, fresh_optimizer)
            now = full_state(model) | full_optimizer_state(model, optimizer)
            found[f"{save}_holds_call_values"] = [k for k, v in saved.items() if not torch.equal(loaded[k], v)]
            found[f"{save}_changed_since"] = all(not torch.equal(now[k], saved[k]) for k in saved if "/" in k)
        # Rank 1 without the recipe (as after a save whose plan it could not replay): both ranks
        # have DCP plan this save, not rank 0 alone replaying; both record the new plan.
        third_recipe = staging.recipe
        if RANK == 1:
            staging.recipe = None
        saved = full_state(model) | full_optimizer_state(model, optimizer)
        handle, staging, copies = save_sharded_staged(
            model, folder, optimizer=optimizer, blocking=False, staging=staging, defer=True, adopt=True
        )
        assert copies is not None
        copies.settle()
        handle.wait(timeout=120)
        dist.barrier()
        found["mixed_planned_again"] = staging.recipe is not None and staging.recipe is not third_recipe
        fresh = fsdp_model(seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        tiekit.load_sharded(fresh, folder, optimizer=fresh_optimizer)
        loaded = full_state(fresh) | full_optimizer_state(fresh, fresh_optimizer)
        found["mixed_holds_call_values"] = [k for k, v in saved.items() if not torch.equal(loaded[k], v)]
        found["mixed"] = handle.save_id
        # A replayed save torn on rank 1 fails on both ranks (DCP's second phase carries the
        # failure), and the save before it stays.
        handle, staging, copies = save_sharded_staged(
            model, folder, optimizer=optimizer, blocking=False, staging=staging, defer=True, adopt=True
        )
        found["replay_torn"] = torn_on_rank_1(model, handle, copies)
        found["replay_torn_recipe"] = staging.recipe is not None
        found["marker_after_replay_torn"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
        return found

    def replicated_extras() -> dict[str, Any]:
        """fit-style background saves whose replicated ``extra`` tensor (one rank writes it) grows,
        changes dtype, then stays: each save is planned again while it changes (a replay would
        write the previous save's metadata for it) and replayed once it stays; each loads."""
        from tiekit.dcp.saving import save_sharded_staged

        model = fsdp_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, optimizer, 0, RANK, WORLD)
        folder = OUT / "replicated-extras"
        staging = None
        found: dict[str, Any] = {"loaded": [], "replayed": []}
        values = [torch.arange(3.0), torch.arange(4.0), torch.arange(4.0, dtype=torch.float64)]
        for value in [*values, values[-1] + 1, values[-1] + 2]:
            previous = None if staging is None else staging.recipe
            handle, staging, copies = save_sharded_staged(
                model, folder, optimizer=optimizer, extra={"t": value}, blocking=False, staging=staging, defer=True
            )
            assert copies is not None
            copies.settle()
            handle.wait(timeout=120)
            dist.barrier()  # rank 0 committed
            found["replayed"].append(previous is not None and staging.recipe is previous)
            loaded = tiekit.load_sharded(fsdp_model(seed=1), folder).extra["t"]
            found["loaded"].append(loaded.dtype == value.dtype and torch.equal(loaded, value))
        return found

    def errors() -> dict[str, Any]:
        """Failures raised on every rank, none left waiting."""
        out: dict[str, Any] = {}
        model = fsdp_model()
        try:
            tiekit.save_sharded(model, OUT / f"rank-path-{RANK}")
        except tiekit.CheckpointError as exc:
            out["different_paths"] = str(exc)
        for name in ("paths-a", "paths-b"):
            tiekit.save_sharded(model, OUT / name)
        out["linked"] = linked(model)
        try:  # two checkpoints, each whole: a rank-dependent path must not read as a save replaced
            tiekit.load_sharded(fsdp_model(seed=1), OUT / ("paths-a" if RANK == 0 else "paths-b"))
        except tiekit.CheckpointError as exc:
            out["load_different_paths"] = str(exc)
        other = tiekit.shard(nn.Sequential(nn.Linear(DIM, 3)))
        try:
            tiekit.load_sharded(other, OUT / "fsdp")
        except tiekit.CheckpointError as exc:
            out["another_model"] = str(exc)
        out["not_shared"] = not_shared(model)
        out["write_fails"] = write_fails(model)
        out["disagreeing"] = disagreeing()
        out["same_model"] = same_model()
        return out

    def linked(model: nn.Module) -> str:
        """One folder, which rank 1 names through a symbolic link: the same folder, saved and loaded
        (it was refused as "needs the same folder on every rank")."""
        if RANK == 0:
            (OUT / "linked").mkdir()
            (OUT / "link").symlink_to(OUT / "linked")
        torch.distributed.barrier()
        try:
            tiekit.save_sharded(model, OUT / ("linked" if RANK == 0 else "link"))
            fresh = fsdp_model(seed=1)
            tiekit.load_sharded(fresh, OUT / ("link" if RANK == 0 else "linked"))
        except tiekit.CheckpointError as exc:
            return str(exc)
        loaded, saved = full_state(fresh), full_state(model)
        same = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
        return "saved and loaded" if same else "loaded other values"

    def same_model() -> dict[str, Any]:
        """`tiekit.collective_check_same_model`, the check to make before `tiekit.shard`: silent
        where the ranks agree, an error on every rank where rank 1's tie is broken."""
        torch.manual_seed(0)
        model = tied_lm()
        tiekit.collective_check_same_model(model)  # the same model everywhere: nothing to say
        if RANK == 1:
            model.head.weight = nn.Parameter(model.head.weight.detach().clone())
        try:
            tiekit.collective_check_same_model(model)
            return {"error": "rank 1's broken tie was not seen"}
        except tiekit.TiekitError as exc:
            return {"refused": str(exc)}

    def disagreeing() -> dict[str, Any]:
        """Replicas whose models differ (rank 1's tie broken; rank 1 built with another shape): no
        checkpoint can describe both, so the save is refused on every rank, blocking or not, and
        the previous one stays. The control: with the ranks' check out of the way, the untied
        model is committed, rank 1's own head.weight stored under a plan that ties it away."""
        import tiekit.dcp.saving as saving

        folder, fresh_folder = OUT / "disagreeing", OUT / "disagreeing-new"
        torch.manual_seed(0)
        model = tied_lm()
        found: dict[str, Any] = {"first": tiekit.save_sharded(model, folder).save_id}
        if RANK == 1:  # a move without tiekit on this rank only
            model.head.weight = nn.Parameter(model.head.weight.detach().clone())
        for name, blocking, target in (
            ("untied", True, folder),
            ("untied_async", False, folder),
            ("new", True, fresh_folder),
        ):
            try:
                tiekit.save_sharded(model, target, blocking=blocking).wait(timeout=120)
                found[name] = None
            except tiekit.CheckpointError as exc:
                found[name] = str(exc)
        torch.manual_seed(0)
        other = tied_lm()
        if RANK == 1:
            other.embed = nn.Embedding(VOCAB + 1, DIM)  # another configuration on this rank, tied too
            other.head.weight = other.embed.weight
        try:
            tiekit.save_sharded(other, folder)
            found["shape"] = None
        except tiekit.CheckpointError as exc:
            found["shape"] = str(exc)
        found.update(declared_and_sharded())
        dist.barrier()  # rank 0 has removed the folder its refused save made
        found["new_folder_exists"] = fresh_folder.exists()
        found["marker"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
        reloaded = tied_lm()
        tiekit.load_sharded(reloaded, folder)
        found["loads_first"] = reloaded.head.weight is reloaded.embed.weight
        # An optimizer on rank 0 only: its state is read collectively, by rank 0 alone (hung before).
        optimizer = torch.optim.AdamW(reloaded.parameters())
        reloaded(batch(0)).sum().backward()
        optimizer.step()
        tiekit.save_sharded(reloaded, OUT / "with-optimizer", optimizer=optimizer)
        try:
            tiekit.load_sharded(reloaded, OUT / "with-optimizer", optimizer=optimizer if RANK == 0 else None)
            found["optimizer_on_one_rank"] = None
        except tiekit.CheckpointError as exc:
            found["optimizer_on_one_rank"] = str(exc)
        digest = saving.digest
        saving.digest = lambda side: "the same everywhere"  # the control: no agreement check
        try:
            found["control_save"] = tiekit.save_sharded(model, folder).save_id  # rank 1's tie still broken
        finally:
            saving.digest = digest
        dist.barrier()
        marker = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())
        metadata = FileSystemReader(folder / marker["folder"]).read_metadata()
        found["control_stored"] = sorted(k for k in metadata.state_dict_metadata if not k.startswith("optimizer"))
        found["control_plan"] = [list(g.names) for g in tiekit.TiePlan.from_dict(marker["plan"]).groups]
        return found

    def declared_and_sharded() -> dict[str, Any]:
        """A model that declares its tie (as transformers' do), sharded, rank 1's tie broken before:
        the save compares the declared tie's two tensors. torch.equal of two DTensors is an
        all-reduce, which rank 1 alone started: both ranks waited for good. Equal values save as
        one tie group (as unsharded); values that differ on rank 1 are refused on every rank."""

        class Declared(tiekit.TPUMixin, shard_fsdp2.TiedLM):
            tied_weights: ClassVar[dict[str, str]] = {"head.weight": "embed.weight"}

        found: dict[str, Any] = {}
        for case in ("equal", "changed"):
            torch.manual_seed(0)
            model = Declared(VOCAB, DIM)
            if RANK == 1:
                model.head.weight = nn.Parameter(model.head.weight.detach() + (case == "changed"))
            tiekit.shard(model)
            folder = OUT / f"declared-{case}"
            try:
                tiekit.save_sharded(model, folder)
                reloaded = tied_lm()
                tiekit.load_sharded(reloaded, folder)
                found[f"declared_{case}"] = {"tied": reloaded.head.weight is reloaded.embed.weight}
            except tiekit.CheckpointError as exc:
                found[f"declared_{case}"] = {"refused": str(exc)}
        return found

    def not_shared(model: nn.Module) -> dict[str, Any]:
        """Rank 1's files land where rank 0 cannot see them (as on a host-local disk of another
        host): the save is refused on every rank, blocking or not, and the previous one stays."""
        import tiekit.dcp.writer as files  # where save_sharded finds its writer

        folder = OUT / "not-shared"
        first = tiekit.save_sharded(model, folder).save_id
        writer = files.DurableWriter
        if RANK == 1:

            class HostLocal(writer):  # type: ignore[misc, valid-type]
                def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
                    super().__init__(OUT / "rank-1-local-disk" / Path(path).name, *args, **kwargs)

            files.DurableWriter = HostLocal
        found: dict[str, Any] = {}
        try:
            try:
                tiekit.save_sharded(model, folder)
            except tiekit.CheckpointError as exc:
                found["blocking"] = str(exc)
            try:
                tiekit.save_sharded(model, folder, blocking=False).wait(timeout=120)
                found["async"] = None
            except tiekit.CheckpointError as exc:
                found["async"] = str(exc)
        finally:
            files.DurableWriter = writer
        dist.barrier()  # rank 0's background commit has run (its wait returned)
        found["marker"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
        found["first"] = first
        found["save_folders"] = sorted(p.name for p in folder.glob("save-*"))  # the refused ones removed
        fresh = fsdp_model(seed=1)
        tiekit.load_sharded(fresh, folder)
        found["loads"] = torch.equal(full_state(fresh)["embed.weight"], full_state(model)["embed.weight"])
        return found

    def write_fails(model: nn.Module) -> dict[str, Any]:
        """Rank 1's shard file cut short by the filesystem (a file size limit, EFBIG, as a full disk
        fails with ENOSPC), blocking and in the background: refused on every rank, each removing its
        part of the failed save's folder; the previous save stays and loads."""
        import resource
        import signal

        folder = OUT / "write-fails"
        first = tiekit.save_sharded(model, folder).save_id
        found: dict[str, Any] = {"first": first}
        for name, blocking in (("blocking", True), ("async", False)):
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            if RANK == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
            try:
                tiekit.save_sharded(model, folder, blocking=blocking).wait(timeout=120)
                found[name] = None
            except tiekit.CheckpointError as exc:
                found[name] = str(exc)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        dist.barrier()  # both ranks have removed their parts
        found["save_folders"] = sorted(p.name for p in folder.glob("save-*"))
        found["marker"] = json.loads((folder / tiekit.dcp.MARKER_NAME).read_text())["save_id"]
        fresh = fsdp_model(seed=1)
        found["loads"] = tiekit.load_sharded(fresh, folder).save_id == first
        return found

    return [
        ("fsdp", fsdp),
        ("ddp", ddp),
        ("async", asynchronous),
        ("deferred", deferred),
        ("replicated_extras", replicated_extras),
        ("errors", errors),
    ]


def load_scenarios() -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    from safetensors.torch import load_file

    def compare(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
        return max((state[k] - v).abs().max().item() for k, v in reference.items())

    def fsdp() -> dict[str, Any]:
        """The 2-rank checkpoint on WORLD ranks: values, ties, optimizer state, the next step."""
        model = fsdp_model(seed=7)  # other weights: the load must replace them
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        result = tiekit.load_sharded(model, OUT / "fsdp", optimizer=optimizer)
        loaded = full_state(model)
        found = {
            "tied": model.head.weight is model.embed.weight,
            "parameters": len(list(model.parameters())),
            "extra": result.extra,
            "retied": [list(g.names) for g in result.retied],
            "difference": compare(loaded, load_file(OUT / "fsdp-saved.safetensors")),
            "optimizer_difference": compare(
                full_optimizer_state(model, optimizer), load_file(OUT / "fsdp-saved-optimizer.safetensors")
            ),
        }
        found["loss_after"] = step(model, optimizer, 2, RANK, WORLD)
        found["difference_after_step"] = compare(full_state(model), load_file(OUT / "fsdp-after-step.safetensors"))
        found["tied_after_step"] = model.head.weight is model.embed.weight
        return found

    def meta() -> dict[str, Any]:
        """Into a model built on the meta device (one process): allocated once per tie, re-tied."""
        with torch.device("meta"):
            model = tied_lm()
        model.head.weight = nn.Parameter(torch.empty(VOCAB, DIM, device="meta"))  # as to_empty leaves it: untied
        tiekit.load_sharded(model, OUT / "fsdp")
        state = full_state(model)
        return {
            "tied": model.head.weight is model.embed.weight,
            "device": str(model.embed.weight.device),
            "difference": compare(state, load_file(OUT / "fsdp-saved.safetensors")),
        }

    def ddp() -> dict[str, Any]:
        model = tied_lm()
        tiekit.load_sharded(model, OUT / "ddp")
        return {
            "tied": model.head.weight is model.embed.weight,
            "difference": compare(full_state(model), load_file(OUT / "ddp-saved.safetensors")),
        }

    def asynchronous() -> dict[str, Any]:
        model = fsdp_model(seed=7)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tiekit.load_sharded(model, OUT / "async", optimizer=optimizer)
        return {
            "tied": model.head.weight is model.embed.weight,
            "difference": compare(full_state(model), load_file(OUT / "async-saved.safetensors")),
        }

    def hsdp() -> dict[str, Any]:
        """HSDP, FSDP2 on a 2-D mesh (2 replicas of 2 shards, as across and within nodes): the 2-rank
        checkpoint loads into it, and its own save holds each shard once and loads back tied."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(7)
        model = tiekit.shard(tied_lm(), mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tiekit.load_sharded(model, OUT / "fsdp", optimizer=optimizer)
        found = {
            "placements": str(model.embed.weight.placements),
            "tied": model.head.weight is model.embed.weight,
            "difference": compare(full_state(model), load_file(OUT / "fsdp-saved.safetensors")),
        }
        step(model, optimizer, 2, RANK, WORLD)
        tiekit.save_sharded(model, OUT / "hsdp")
        saved = full_state(model)
        if RANK == 0:
            save_tensors(saved, OUT / "hsdp-saved.safetensors")
        found["bytes"] = disk_bytes(OUT / "hsdp")
        found["unique_bytes"] = sum(v.numel() * v.element_size() for k, v in saved.items() if k != "head.weight")
        torch.manual_seed(8)
        fresh = tiekit.shard(tied_lm(), mesh=mesh)
        tiekit.load_sharded(fresh, OUT / "hsdp")
        found["reloaded_tied"] = fresh.head.weight is fresh.embed.weight
        found["reloaded_difference"] = compare(full_state(fresh), saved)
        return found

    def damaged() -> dict[str, Any]:
        """A copy of the 2-rank checkpoint whose last model record in rank 1's shard file is damaged
        in place: only the rank reading it finds it, and every rank refuses the load, naming the
        file and key, its weights as they were (DCP would have loaded the records before it)."""
        import shutil

        folder = OUT / "damaged"
        if RANK == 0:
            shutil.copytree(OUT / "fsdp", folder)
            (save,) = folder.glob("save-*")
            storage = FileSystemReader(save).read_metadata().storage_data
            records = [
                (where.offset, where.length, index.fqn)
                for index, where in storage.items()
                if where.relative_path == "__1_0.distcp" and not index.fqn.startswith(("optimizer/", "extra/"))
            ]
            offset, length, key = max(records)
            shard = save / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[offset + length - 80 : offset + length - 16] = bytes(64)  # inside its zip directory
            shard.write_bytes(bytes(data))
            (OUT / "damaged-key").write_text(key)
        dist.barrier()
        model = fsdp_model(seed=7)
        before = full_state(model)
        try:
            tiekit.load_sharded(model, folder)
            refused = None
        except tiekit.CheckpointError as exc:
            refused = str(exc)
        after = full_state(model)
        return {
            "refused": refused,
            "key": (OUT / "damaged-key").read_text(),
            "changed": [k for k, v in before.items() if not torch.equal(v, after[k])],
            "tied": model.head.weight is model.embed.weight,
        }

    scenarios = [("fsdp", fsdp), ("ddp", ddp), ("async", asynchronous)]
    if WORLD == 2:
        scenarios.append(("damaged", damaged))
    if WORLD == 1:
        scenarios.append(("meta", meta))
    if WORLD == 4:
        scenarios.append(("hsdp", hsdp))
    return scenarios


def main() -> None:
    if WORLD > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=WORLD)
    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    scenarios = save_scenarios() if MODE == "save" else load_scenarios()
    try:
        for name, scenario in scenarios:
            try:
                found[name] = scenario()
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                found[name] = {"error": traceback.format_exc()}
    finally:
        (OUT / f"{MODE}-{WORLD}-rank{RANK}.json").write_text(json.dumps(found, indent=1))
        if WORLD > 1:
            collective_close_process_group()  # meet before destroying: gloo aborted at exit without it


if __name__ == "__main__":
    MODE, RANK, WORLD, PORT, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    main()
