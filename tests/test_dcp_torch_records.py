"""Shard-file records written from templates (`tiekit.dcp.torch_records`) are the bytes
``torch.save`` writes, and a shard file `DurableWriter` writes is the file DCP's own writer
writes for the same state (both without record checksums)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from tiekit.dcp import torch_records
from tiekit.dcp.torch_records import write_record
from tiekit.dcp.writer import DurableWriter, records_without_checksums


def saved(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(t, out)
    return out.getvalue()


def recorded(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    write_record(out, t)
    return out.getvalue()


def layouts() -> list[torch.Tensor]:
    """One tensor per layout: dtypes, 0-d, 1-element, odd sizes, a transposed (strided) one."""
    g = torch.Generator().manual_seed(0)
    found = [
        torch.randn(1000, 7, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(5, 2, generator=g).to(torch.float16),
        torch.tensor(5.0),
        torch.tensor([7], dtype=torch.int64),
        torch.randint(0, 2, (9,), generator=g).bool(),
        torch.randint(0, 255, (4097,), generator=g).to(torch.uint8),
        torch.randn(4, 3, generator=g).t(),  # strides (1, 3), its storage whole
        torch.complex(torch.randn(6, generator=g), torch.randn(6, generator=g)),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        found.append(torch.randn(16, generator=g).to(torch.float8_e4m3fn))
    return found


def changed(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s layout (dtype, shape, strides) holding other values."""
    other = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    if t.dtype == torch.bool:
        return other.copy_(~t)
    if t.is_complex():
        return other.copy_(t + 1)
    return other.copy_((t.to(torch.float64) + 1).to(t.dtype))


def test_records_from_templates_are_the_bytes_torch_save_writes() -> None:
    torch_records._templates.clear()
    with records_without_checksums():
        for t in layouts():
            first = recorded(t)  # torch.save's own, its template kept
            assert torch_records._templates.get(torch_records.layout_of(t)) is not None, t.dtype
            other = changed(t)
            assert first == saved(t), t.dtype
            assert saved(other) != first  # other values, so a template holding them would show
            assert recorded(other) == saved(other), (t.dtype, tuple(t.shape))  # from the template
            assert torch.equal(torch.load(io.BytesIO(recorded(other)), weights_only=True), other)


def test_values_change_only_the_data_bytes_of_a_record() -> None:
    """The premise of templates, shown on torch.save itself: two tensors of one layout differ in
    their records exactly where their values do."""
    a, b = torch.randn(300, 5), torch.randn(300, 5)
    with records_without_checksums():
        x, y = saved(a), saved(b)
    start = x.find(a.numpy().tobytes())
    assert start > 0 and len(x) == len(y)
    differ = [i for i in range(len(x)) if x[i] != y[i]]
    assert differ and min(differ) >= start and max(differ) < start + a.nbytes


def test_without_a_template_torch_save_writes_the_record() -> None:
    """Checksums on (they depend on the values), a view of a larger storage, an empty tensor, a
    tensor requiring grad: torch.save's bytes, and no template kept for them."""
    torch_records._templates.clear()
    base = torch.randn(10, 10)
    cases = [base[2:4], torch.empty(0, 3), torch.randn(4, requires_grad=True)]
    with records_without_checksums():
        for t in cases:
            assert torch_records.layout_of(t) is None
            assert recorded(t) == saved(t)
    checked = torch.randn(50)
    if hasattr(torch.serialization, "set_crc32_options"):
        assert torch.serialization.get_crc32_options()
    assert torch_records.layout_of(checked) is None  # checksums on: torch.save writes it
    assert recorded(checked) == saved(checked)
    assert not torch_records._templates


def test_a_record_whose_bytes_are_not_found_is_left_to_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that wrote the tensor's bytes in pieces (not as its own memory in one write) gives
    no template: the layout stays with torch.save, and the records stay torch.save's."""
    torch_records._templates.clear()
    monkeypatch.setattr(torch_records, "_address", lambda view: -1)  # the tensor's write never recognized
    t = torch.randn(64)
    with records_without_checksums():
        assert recorded(t) == saved(t)
        key = torch_records.layout_of(t)
        assert key in torch_records._templates and torch_records._templates[key] is None
        assert recorded(t + 1) == saved(t + 1)


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.distcp"))}


def storage(folder: Path) -> dict[str, tuple[str, int, int]]:
    with (folder / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    return {
        f"{index.fqn}@{tuple(index.offset or ())}": (s.relative_path, s.offset, s.length)
        for index, s in metadata.storage_data.items()
    }


def test_a_shard_file_is_the_file_dcps_own_writer_writes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    torch_records._templates.clear()
    g = torch.Generator().manual_seed(1)
    big = torch.randn(64, 32, generator=g)
    state = {
        "embed": torch.randn(300, 64, generator=g),
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "row_view": big[3:5],  # a view: DCP's loop writes a copy owning its storage
        "transposed": torch.randn(8, 4, generator=g).t(),
        "step": torch.tensor(12.0),
        "counts": torch.arange(5),
        "mask": torch.ones(3, dtype=torch.bool),
        "empty": torch.empty(0, 2),
        "note": {"text": "not a tensor", "n": 3},  # a byte item
    }
    for round_ in range(2):  # the second from templates
        ours, theirs = tmp_path / f"ours-{round_}", tmp_path / f"theirs-{round_}"
        dcp.save(state, storage_writer=DurableWriter(ours), no_dist=True)
        with records_without_checksums():
            dcp.save(state, storage_writer=FileSystemWriter(theirs, sync_files=True), no_dist=True)
        assert shard_files(ours) == shard_files(theirs)
        assert storage(ours) == storage(theirs)
    assert len(torch_records._templates) >= 5
    loaded = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    loaded["note"] = {"text": None, "n": None}
    dcp.load(loaded, checkpoint_id=ours, no_dist=True)
    for k, v in state.items():
        assert torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v, k
