"""A background sharded save writes its host copies from a `ShardImage` (`tiekit.dcp.shard_image`):
the copies are laid out as the shard file's records, which go to the file from where they are.
The file is a DCP shard file every reader takes (each record the bytes torch.save writes); an
image the plan does not wholly cover is written record by record, as DCP's own writer would."""

from __future__ import annotations

import io
import itertools
import pickle
import threading
from pathlib import Path
from typing import Any

import torch
from held_writers import writer_held
from models import assert_sharded_round_trip
from torch import nn

import tiekit
from tiekit.dcp.shard_image import ShardImage
from tiekit.dcp.staging import host_copies
from tiekit.dcp.writer import DurableWriter, records_without_checksums


class Tied(nn.Module):
    def __init__(self, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def trained(vocab: int = 1000) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied(vocab)
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: Tied, optimizer: torch.optim.Optimizer) -> None:
    model(torch.arange(9)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def records(folder: Path) -> list[tuple[str, int, int]]:
    """(key, offset, length) of every item in ``folder``'s shard file, in file order."""
    with (folder / ".metadata").open("rb") as f:
        storage = pickle.load(f).storage_data
    return sorted(((index.fqn, s.offset, s.length) for index, s in storage.items()), key=lambda r: r[1])


def saved(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    with records_without_checksums():
        torch.save(t.detach().clone(), out)
    return out.getvalue()


def test_a_background_save_writes_its_records_from_the_image(tmp_path: Path) -> None:
    model, optimizer = trained()
    tiekit.save_sharded(model, tmp_path / "blocking", optimizer=optimizer)  # record by record: the control
    tiekit.save_sharded(model, tmp_path / "background", optimizer=optimizer, blocking=False).wait(60)
    blocking = records(next((tmp_path / "blocking").glob("save-*")))
    folder = next((tmp_path / "background").glob("save-*"))
    imaged = records(folder)
    assert sorted(r[0] for r in imaged) == sorted(r[0] for r in blocking)
    gaps = [b[1] - (a[1] + a[2]) for a, b in itertools.pairwise(imaged)]
    assert all(offset % 64 == 0 for _, offset, _ in imaged) and any(gaps)  # the image's record starts
    assert not any(b[1] - (a[1] + a[2]) for a, b in itertools.pairwise(blocking))  # back to back
    raw = next(folder.glob("*.distcp")).read_bytes()
    state = {"embed.weight": model.embed.weight, "norm.weight": model.norm.weight, "norm.bias": model.norm.bias}
    for key, offset, length in imaged:
        if key in state:
            assert raw[offset : offset + length] == saved(state[key]), key
    assert_sharded_round_trip(model, optimizer, tmp_path / "background", Tied(), ("embed", "head"))


def test_an_image_the_plan_does_not_wholly_cover_is_written_as_dcp_writes(tmp_path: Path) -> None:
    """An image with a record no planned tensor is (DCP gave it to another rank): the file is the
    one DCP's own writer writes for the state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    model, _ = trained()
    tensors = {name: p.detach() for name, p in model.named_parameters()} | {"elsewhere": torch.randn(5)}
    hosts, _ = host_copies(tensors)
    assert hosts.image is not None
    del hosts["elsewhere"]
    dcp.save(dict(hosts), storage_writer=DurableWriter(tmp_path / "ours", image=hosts.image), no_dist=True)
    with records_without_checksums():
        dcp.save(dict(hosts), storage_writer=FileSystemWriter(tmp_path / "dcp", sync_files=True), no_dist=True)
    assert (tmp_path / "ours" / "__0_0.distcp").read_bytes() == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()
    assert records(tmp_path / "ours") == records(tmp_path / "dcp")


def test_a_lent_image_the_plan_does_not_wholly_cover_is_written_from_its_memory(tmp_path: Path) -> None:
    """As above, the image lent (its tensors are training state): each of its records is written
    from the lent memory, and the file is still DCP's own; taking the image back afterwards
    copies nothing (the writer gave it back when done)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    model, _ = trained()
    tensors = {name: p.detach() for name, p in model.named_parameters()} | {"elsewhere": torch.randn(5)}
    hosts, _ = host_copies(tensors)
    assert hosts.image is not None
    del hosts["elsewhere"]
    lent = hosts.image.lend()
    writer = DurableWriter(tmp_path / "ours", image=hosts.image, lent=lent)
    dcp.save(dict(hosts), storage_writer=writer, no_dist=True)
    lent.take_back()
    assert lent.copied == 0
    with records_without_checksums():
        dcp.save(dict(hosts), storage_writer=FileSystemWriter(tmp_path / "dcp", sync_files=True), no_dist=True)
    assert (tmp_path / "ours" / "__0_0.distcp").read_bytes() == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()


def test_staged_copies_reuse_their_image_until_a_layout_changes() -> None:
    model, _ = trained()
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    first, _ = host_copies(tensors)
    again, _ = host_copies(tensors, staging=first)
    assert again.image is first.image and first.image is not None
    assert all(again[k].data_ptr() == first[k].data_ptr() for k in tensors)
    assert all(torch.equal(again[k], v) for k, v in tensors.items())
    grown = dict(tensors, **{"norm.bias": torch.zeros(65)})
    changed, _ = host_copies(grown, staging=again)
    assert changed.image is not again.image
    assert torch.equal(changed["norm.bias"], torch.zeros(65)) and torch.equal(
        changed["embed.weight"], tensors["embed.weight"]
    )


def test_image_tensors_own_exactly_their_slots() -> None:
    image = ShardImage(
        [(torch.Size([3, 5]), torch.float32), (torch.Size([0]), torch.float32), (torch.Size([7]), torch.bfloat16)]
    )
    full, empty, half = image.tensors
    assert empty is None and full is not None and half is not None
    for t in (full, half):
        assert t.untyped_storage().nbytes() == t.nbytes and t.is_contiguous()
    full.copy_(torch.arange(15.0).reshape(3, 5))
    half.copy_(torch.ones(7))
    raw = bytes(image.records())
    slots = [s for s in image.slots if s is not None]
    assert raw[slots[0].start : slots[0].end] == saved(full)
    assert raw[slots[1].start : slots[1].end] == saved(half)


def state_of(model: Tied, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    moments = {f"{n}/{k}": v.clone() for n, p in model.named_parameters() for k, v in optimizer.state[p].items()}
    return {**{k: v.clone() for k, v in model.state_dict().items()}, **moments}


def stored(folder: Path) -> dict[str, torch.Tensor]:
    fresh = Tied(4000)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    tiekit.load_sharded(fresh, folder, optimizer=fresh_optimizer)
    assert fresh.head.weight is fresh.embed.weight
    return state_of(fresh, fresh_optimizer)


def test_fits_background_saves_train_the_optimizer_state_in_the_image_and_write_it_from_there(tmp_path: Path) -> None:
    """fit's way (``adopt=True``): the first save copies the moments into its image and its
    ``settle`` moves them there; the next save finds them there (nothing to copy) and writes them
    from the image lent to its writer. Held after its first chunk, the writer goes on from what
    ``settle`` took aside for it, while the optimizer step changes the image: each checkpoint
    holds the values of its call (the live state has moved on, so a write from the image would not)."""
    from tiekit.checkpoint.image import LENT_CHUNK
    from tiekit.dcp.saving import save_sharded_staged

    model, optimizer = trained(4000)  # 1 MB a tensor: the image is written in several chunks
    staging = None
    for step in (1, 2):
        expected = state_of(model, optimizer)
        with writer_held("sharded"):  # the writer starts once its first chunk can be held
            handle, staged, copies = save_sharded_staged(
                model, tmp_path / "ck", optimizer=optimizer, blocking=False, staging=staging, defer=True, adopt=True
            )
            assert copies is not None and copies.lent is not None and staged.image is not None
            image = staged.image
            assert (image is getattr(staging, "image", None)) == (step == 2)
            moments = [v for p in model.parameters() for v in optimizer.state[p].values()]
            assert [image.holds(m) for m in moments] == [step == 2] * len(moments)
            first_chunk = pause_after_first_chunk(copies.lent)
        assert first_chunk.wait(60)
        copies.settle()  # takes the image back: the rest goes aside
        assert copies.lent.copied == image.size - LENT_CHUNK
        moments = [v for p in model.parameters() for v in optimizer.state[p].values()]
        assert all(image.holds(m) for m in moments) and not image.holds(model.embed.weight)
        assert all(torch.equal(v, expected[k]) for k, v in state_of(model, optimizer).items())
        train_step(model, optimizer)  # changes the moments in the image
        now = state_of(model, optimizer)
        assert not torch.equal(now["embed.weight/exp_avg"], expected["embed.weight/exp_avg"])
        resume_writer(copies.lent)
        handle.wait(60)
        got = stored(tmp_path / "ck")
        assert got.keys() == expected.keys()
        assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == [], step
        staging = staged
    assert model.head.weight is model.embed.weight


_resume: dict[int, threading.Event] = {}


def pause_after_first_chunk(lent: Any) -> threading.Event:
    """An event set when ``lent``'s writer has written its first chunk; the writer then waits for
    `resume_writer`."""
    from tiekit.checkpoint.image import LENT_CHUNK

    reached, go_on = threading.Event(), threading.Event()
    _resume[id(lent)] = go_on
    chunk_written = lent.written

    def written(end: int) -> None:
        chunk_written(end)
        if end == LENT_CHUNK:
            reached.set()
            go_on.wait(60)

    lent.written = written
    return reached


def resume_writer(lent: Any) -> None:
    _resume.pop(id(lent)).set()
