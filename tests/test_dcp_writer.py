"""`save_sharded`'s shard files go past the page cache (`tiekit.dcp.writer`): after a save their
pages are not cached, where DCP's own writer leaves them all cached (the control); the folder
loads back as DCP wrote it. Page-cache residency is the kernel's own answer (``mincore``)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch
from models import assert_sharded_round_trip
from torch import nn

import tiekit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT and mincore as Linux has them")


def cached_fraction(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = (ctypes.c_ubyte * pages)()
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        resident = sum(v & 1 for v in vector)
    return resident / pages


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4000, 512)  # 8.2 MB: more than one 8 MiB chunk
        self.proj = nn.Linear(512, 512)
        self.head = nn.Linear(512, 4000, bias=False)
        self.head.weight = self.embed.weight


def accepts_o_direct(folder: Path) -> bool:
    """Whether the file system of ``folder`` takes ``O_DIRECT`` writes (tmpfs on older kernels does not)."""
    probe = folder / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as block:
            os.write(fd, block)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink()


def test_shard_files_are_written_past_the_page_cache(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if not accepts_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT (the writer falls back to the page cache)")

    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.proj(model.embed(torch.arange(8)))).sum().backward()
    optimizer.step()
    tiekit.save_sharded(model, tmp_path / "ours", optimizer=optimizer)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "plain")  # DCP's own writer: the control
    ours = list((tmp_path / "ours").glob("save-*/*.distcp"))
    plain = list((tmp_path / "plain").glob("*.distcp"))
    assert len(ours) == 1 and len(plain) == 1
    assert cached_fraction(plain[0]) > 0.9
    assert cached_fraction(ours[0]) < 0.05
    assert_sharded_round_trip(model, optimizer, tmp_path / "ours", TiedLM(), ("embed", "head"))


def record_checksums(folder: Path) -> list[int]:
    """The CRC32 fields of every tensor record in ``folder``'s shard files (each record is a
    ``torch.save`` zip archive at the offset DCP's metadata gives)."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(folder).read_metadata().storage_data
    found = []
    for info in storage.values():
        with (folder / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            found += [m.CRC for m in archive.infolist() if "/data/" in m.filename and m.file_size]
    return found


def test_shard_records_are_written_without_the_checksum_torch_load_never_reads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = TiedLM()
    before = torch.serialization.get_crc32_options()
    tiekit.save_sharded(model, tmp_path / "ours")
    assert torch.serialization.get_crc32_options() == before  # set back after the write
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "plain")  # DCP's own: the control
    ours = record_checksums(next((tmp_path / "ours").glob("save-*")))
    plain = record_checksums(tmp_path / "plain")
    assert ours and all(crc == 0 for crc in ours)
    assert plain and all(crc != 0 for crc in plain)
    fresh = TiedLM()
    tiekit.load_sharded(fresh, tmp_path / "ours")
    assert fresh.head.weight is fresh.embed.weight
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_torch_save_of_another_thread_during_a_save_loads(tmp_path: Path) -> None:
    """The checksum option is process-wide: a torch.save made while shards are written has no
    checksums, and torch.load reads it."""
    from tiekit.dcp.writer import records_without_checksums

    value = torch.randn(1000)
    with records_without_checksums():
        torch.save(value, tmp_path / "during.pt")
    assert torch.equal(torch.load(tmp_path / "during.pt", weights_only=True), value)
