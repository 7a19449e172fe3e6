"""`tiekit.checkpoint.direct.write_safetensors`: the bytes safetensors writes, from the tensors' own
memory, past the page cache where the file system allows (real files, read back by safetensors);
and `tiekit.checkpoint.image`, the same bytes written from a file image."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import tiekit
from tiekit.checkpoint import direct
from tiekit.checkpoint import image as file_image
from tiekit.checkpoint.direct import write_safetensors

METADATA = {"tiekit.plan": '{"groups":[]}', "format": "pt", "long": "x" * 5000}


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(3000, 700),  # 8.4 MB: more than one 8 MiB write
        "optimizer/0/exp_avg": torch.randn(3000, 700).bfloat16(),
        "half": torch.randn(7, 3).half(),
        "int32": torch.arange(6, dtype=torch.int32),
        "double": torch.randn(2, dtype=torch.float64),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(3),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }


def split(path: Path) -> tuple[int, Any, bytes]:
    """(header length, header, data bytes) of a safetensors file. The header is compared parsed:
    safetensors writes its metadata from a Rust HashMap, in an order that changes between runs."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return length, (header, order), raw[8 + length :]


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_the_file_is_the_one_safetensors_writes(tmp_path: Path, direct_io: bool) -> None:
    tensors = state()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(tensors, ours, METADATA, direct=direct_io)
    save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata=METADATA)
    assert split(ours) == split(theirs)
    back = load_file(ours)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(back[name], value) and back[name].dtype == value.dtype, name
    with safe_open(ours, "pt") as f:
        assert f.metadata() == METADATA


def test_every_dtype_safetensors_stores_is_written_in_its_order(tmp_path: Path) -> None:
    """complex64 and the float8 variants safetensors 0.8 stores were refused ("safetensors cannot
    store"); each dtype's place in the file follows safetensors' own order."""
    names = ["complex64", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    names += ["float8_e8m0fnu", "int8", "bool"]
    tensors = {f"t{i}": torch.randn(6).to(getattr(torch, n)) for i, n in enumerate(names) if hasattr(torch, n)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(tensors, ours, METADATA)
    save_file(tensors, theirs, metadata=METADATA)
    assert split(ours) == split(theirs)
    tiekit.save_model(nn.ParameterDict({k: nn.Parameter(v, requires_grad=False) for k, v in tensors.items()}), tmp_path)
    assert load_file(tmp_path / "model.safetensors").keys() == tensors.keys()


def refuse_direct_opens(monkeypatch: pytest.MonkeyPatch, answer: int) -> list[str]:
    """``os.open`` refuses O_DIRECT with ``answer``, as tmpfs and some network file systems do;
    the paths refused are appended to the list returned."""
    opened = os.open
    refused: list[str] = []

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            refused.append(os.fspath(path))
            raise OSError(answer, os.strerror(answer))
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    return refused


@pytest.mark.parametrize("answer", [errno.EINVAL, errno.EOPNOTSUPP], ids=["EINVAL", "EOPNOTSUPP"])
def test_a_file_system_without_o_direct_gets_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: int
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform: every write is buffered")
    refused = refuse_direct_opens(monkeypatch, answer)
    tensors = state()
    write_safetensors(tensors, tmp_path / "ours.safetensors", METADATA)
    monkeypatch.undo()
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "theirs.safetensors", metadata=METADATA)
    assert refused == [os.fspath(tmp_path / "ours.safetensors")]
    assert split(tmp_path / "ours.safetensors") == split(tmp_path / "theirs.safetensors")


def test_what_safetensors_cannot_hold_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    w = torch.ones(2, 2)
    cases = {
        "complex": ({"z": torch.ones(2, dtype=torch.complex128)}, "tensor 'z' has dtype torch.complex128"),
        "meta": ({"m": torch.empty(2, device="meta")}, "tensor 'm' is on meta, not on the CPU"),
        "twice": ({"a": w, "b": w}, "tensors 'a' and 'b' share memory"),
    }
    for tensors, message in cases.values():
        with pytest.raises(tiekit.CheckpointError, match=message):
            write_safetensors(tensors, path, {})
        assert not path.exists()  # refused before the file is opened


def test_saves_use_it_and_load_back(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight
    tiekit.save_model(model, tmp_path / "model.safetensors")
    tiekit.save_model(model, tmp_path / "fast.safetensors", durable=False)
    for name in ("model.safetensors", "fast.safetensors"):
        fresh = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        tiekit.load_model(fresh, tmp_path / name)
        assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight, model[0].weight)
    assert direct.CHUNK % direct.BLOCK == 0


class LazyViews(nn.Module):
    """Buffers whose values torch keeps lazily: a conjugate view and a negative view (the
    imaginary part of a conjugate), beside an ordinary parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("conj", torch.randn(3, dtype=torch.complex64).conj())
        self.register_buffer("neg", torch.randn(2, 3, dtype=torch.complex64).conj().imag)
        self.weight = nn.Parameter(torch.randn(4))


@pytest.mark.parametrize("durable", [True, False], ids=["direct", "buffered"])
def test_conjugate_and_negative_views_save_their_values(tmp_path: Path, durable: bool) -> None:
    """save_model of a conjugate view raised torch's RuntimeError (a dtype view of a conjugate view).
    The file holds the values, as safetensors' save_file of the resolved tensors writes them (its
    save_file of the view itself writes the unconjugated memory)."""
    model = LazyViews()
    assert model.conj.is_conj() and model.neg.is_neg()
    resolved = {k: v.resolve_conj().resolve_neg().contiguous() for k, v in model.state_dict().items()}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    tiekit.save_model(model, ours, durable=durable)
    save_file(resolved, theirs, metadata=safe_open(ours, "pt").metadata())
    assert split(ours) == split(theirs)
    fresh = nn.Module()
    for name, value in resolved.items():
        fresh.register_buffer(name, torch.zeros_like(value))
    tiekit.load_model(fresh, ours)
    assert all(torch.equal(fresh.get_buffer(k), v) for k, v in resolved.items())


def test_conjugate_and_negative_views_load_their_values(tmp_path: Path) -> None:
    """Loading into a model whose buffers are such views read the file's bytes into their memory,
    which torch refused (a dtype view of a conjugate view): a raw RuntimeError."""
    model, path = LazyViews(), tmp_path / "views.safetensors"
    tiekit.save_model(model, path)
    into = LazyViews()
    with torch.no_grad():
        for t in (into.conj, into.neg, into.weight):
            t.zero_()
    tiekit.load_model(into, path)
    assert all(torch.equal(into.get_buffer(k), model.get_buffer(k)) for k in ("conj", "neg"))
    assert torch.equal(into.weight, model.weight)


def test_the_bytes_of_an_ordinary_tensor_are_its_own_memory() -> None:
    t = torch.randn(5, 3)
    assert direct.host_bytes(t).ctypes.data == t.data_ptr()  # no copy
    c = torch.randn(3, dtype=torch.complex64)
    assert direct.host_bytes(c.conj()).tobytes() == c.conj().resolve_conj().numpy().tobytes()


def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path: Path) -> None:
    rng = torch.Generator().manual_seed(1)
    sizes = [3, 4093, direct.CHUNK - 5, 1, direct.CHUNK * 2 + 17, 0, 511, 4096]
    pieces = [torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes() for n in sizes]
    path = tmp_path / "stream.bin"
    written = b""
    with direct.DirectFile(path) as out:
        for i, piece in enumerate(pieces):
            assert out.write(memoryview(piece)) == len(piece)
            written += piece
            assert out.tell() == len(written)
            if i in (1, 3):  # fileno() puts every byte so far in the file, as DCP asks before fsync
                os.fsync(out.fileno())
                assert path.read_bytes() == written
    assert path.read_bytes() == written


def test_many_small_pieces_across_chunks_are_the_bytes_written(tmp_path: Path) -> None:
    # torch.save hands its zip headers over a few bytes at a time; they take a path of their own
    rng = torch.Generator().manual_seed(2)
    sizes = [*torch.randint(0, 300, (2_000,), generator=rng).tolist(), direct.CHUNK - 100, 99, 2, 4095, 4096]
    sizes += torch.randint(0, 4096, (4_000,), generator=rng).tolist()
    data = torch.randint(0, 256, (sum(sizes),), generator=rng, dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "stream.bin"
    at = 0
    with direct.DirectFile(path) as out:
        for n in sizes:
            assert out.write(data[at : at + n]) == n
            at += n
        floats = np.arange(10, dtype=np.float32)  # a buffer of other items: its bytes, counted in bytes
        assert out.write(floats) == floats.nbytes
        assert out.tell() == len(data) + floats.nbytes
    assert path.read_bytes() == data + floats.tobytes()


def test_torch_save_into_a_direct_file_is_torch_save(tmp_path: Path) -> None:
    import io

    tensors = state()
    expected = io.BytesIO()
    torch.save(tensors, expected)
    with direct.DirectFile(tmp_path / "t.pt") as out:
        torch.save(tensors, out)
    assert (tmp_path / "t.pt").read_bytes() == expected.getvalue()
    back = torch.load(tmp_path / "t.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_file_system_refusing_o_direct_writes_is_written_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some file systems accept O_DIRECT at open and answer EINVAL to the write."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    import fcntl

    written = os.pwrite
    refused: list[int] = []

    def no_direct_writes(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return written(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", no_direct_writes)
    tensors = state()
    write_safetensors(tensors, tmp_path / "ours.safetensors", METADATA)
    monkeypatch.undo()
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "theirs.safetensors", metadata=METADATA)
    assert len(refused) == 1  # refused once, then the flag is off for the rest of the file
    assert split(tmp_path / "ours.safetensors") == split(tmp_path / "theirs.safetensors")


def test_a_failed_write_is_raised_and_the_descriptor_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    opened: list[int] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda *a: opened.append(real_open(*a)) or opened[-1])
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(state(), tmp_path / "full.safetensors", METADATA)
    monkeypatch.undo()
    with pytest.raises(OSError):  # closed by the stream, not leaked
        os.fstat(opened[0])


def test_write_buffers_are_reused_by_the_next_file_of_any_thread(tmp_path: Path) -> None:
    """DCP writes each background save from a new thread: the aligned buffer of one file is the
    next file's, whichever thread writes it (a fresh one costs 2,048 page faults)."""

    used: list[Any] = []

    def write(name: str) -> None:
        with direct.DirectFile(tmp_path / name) as out:
            used.append(out._mapped)
            out.write(memoryview(b"x" * 10))

    for name in ("a", "b"):
        thread = threading.Thread(target=write, args=(name,))
        thread.start()
        thread.join()
    assert used[0] is used[1]
    assert (tmp_path / "b").read_bytes() == b"x" * 10


def filled_image(tensors: dict[str, torch.Tensor], path: Path, reuse: Any = None) -> file_image.FileImage:
    image = file_image.image_for(tensors, path, METADATA, reuse=reuse)
    for name, value in tensors.items():
        image.tensors[name].copy_(value)
    return image


def direct_capable(folder: Path) -> bool:
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except (AttributeError, OSError):
        return False
    return True


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_a_file_image_is_written_as_the_file_safetensors_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: bool
) -> None:
    """The same tensors and header as save_file's, the header padded with spaces so the data
    starts on a block; the direct write goes straight from the image (page-aligned), so the
    file system never refuses it for alignment and no write buffer is taken."""
    tensors = state()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    image = filled_image(tensors, ours)
    assert image.memory.data_ptr() % direct.BLOCK == 0 and image.head % direct.BLOCK == 0
    import fcntl

    written = os.pwrite
    flags: list[bool] = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        flags.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return written(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    buffers = list(direct._free_buffers)
    file_image.write_image(image, ours, direct=direct_io)
    monkeypatch.undo()
    assert direct._free_buffers == buffers  # no aligned write buffer taken: written from the image
    assert flags and all(f == (direct_io and direct_capable(tmp_path)) for f in flags)
    save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata=METADATA)
    length, header, data = split(ours)
    assert (8 + length) % direct.BLOCK == 0 and (header, data) == split(theirs)[1:]
    assert ours.stat().st_size == image.size == 8 + length + len(data)
    back = load_file(ours)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with safe_open(ours, "pt") as f:
        assert f.metadata() == METADATA


def test_a_file_image_refused_o_direct_writes_the_same_bytes_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    tensors = state()
    image = filled_image(tensors, tmp_path / "a.safetensors")
    refused = refuse_direct_opens(monkeypatch, errno.EINVAL)
    file_image.write_image(image, tmp_path / "a.safetensors")
    monkeypatch.undo()
    assert refused == [os.fspath(tmp_path / "a.safetensors")]
    file_image.write_image(image, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_file_image_is_reused_only_for_the_same_layout_with_room_for_the_header(tmp_path: Path) -> None:
    tensors = state()
    path = tmp_path / "x.safetensors"
    image = file_image.image_for(tensors, path, METADATA)
    assert file_image.image_for(tensors, path, {**METADATA, "step": "123456"}, reuse=image) is image
    file_image.write_image(image, path)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {**METADATA, "step": "123456"}  # the reused image holds the new header
    path.unlink()
    reshaped = {**tensors, "half": torch.zeros(3, 7).half()}
    retyped = {**tensors, "ids": tensors["ids"].int()}
    renamed = {**tensors, "more": torch.ones(1)}
    longer = {**METADATA, "long": "x" * (image.head + 1)}
    for other, metadata in ((reshaped, METADATA), (retyped, METADATA), (renamed, METADATA), (tensors, longer)):
        fresh = file_image.image_for(other, path, metadata, reuse=image)
        assert fresh is not image and fresh.memory.data_ptr() != image.memory.data_ptr()
    with pytest.raises(tiekit.CheckpointError, match=r"tensor 'z' has dtype torch\.complex128"):
        file_image.image_for({"z": torch.ones(2, dtype=torch.complex128)}, path, {})


@pytest.mark.parametrize("take_back", [True, False], ids=["taken-back", "control-not-taken-back"])
def test_a_lent_image_taken_back_mid_write_still_writes_the_values_it_held(tmp_path: Path, take_back: bool) -> None:
    """An image that is the training state itself (`LentMemory`): the training thread takes it
    back between two chunks of the write, then changes it (its optimizer step); the file holds
    the values from before. The control does not take it back: the file gets the new values."""
    tensors = state()  # 8.4 + 4.2 MB: the write goes in several chunks
    path = tmp_path / "lent.safetensors"
    image = filled_image(tensors, path)
    lent = file_image.LentMemory(image.memory.numpy(), image.spare)
    first_chunk_done, go_on = threading.Event(), threading.Event()
    chunk_written = lent.written

    def written(end: int) -> None:
        chunk_written(end)
        if end == file_image.LENT_CHUNK:
            first_chunk_done.set()
            go_on.wait(60)  # the writer stands between its first and second chunk

    lent.written = written  # type: ignore[method-assign]
    writer = threading.Thread(target=file_image.write_image, args=(image, path), kwargs={"lent": lent})
    writer.start()
    assert first_chunk_done.wait(60)
    if take_back:
        lent.take_back()
        assert lent.copied == image.memory.numel() - file_image.LENT_CHUNK  # only what was not yet written
    for view in image.tensors.values():  # the optimizer step changes the state living in the image
        view.zero_() if view.dtype == torch.bool else view.add_(1)
    go_on.set()
    writer.join(60)
    back = load_file(path)
    second = [k for k, v in image.tensors.items() if (v.data_ptr() - image.memory.data_ptr()) >= file_image.LENT_CHUNK]
    assert second  # tensors written in the second chunk, after the state changed
    for name in second:
        assert torch.equal(back[name], tensors[name]) is take_back, name


def test_a_lent_image_written_before_it_is_taken_back_copies_nothing(tmp_path: Path) -> None:
    tensors = state()
    path = tmp_path / "lent.safetensors"
    image = filled_image(tensors, path)
    lent = file_image.LentMemory(image.memory.numpy(), image.spare)
    file_image.write_image(image, path, lent=lent)
    lent.close()
    lent.take_back()
    assert lent.copied == 0
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize(
    "size", [0, 100, 4096, direct.CHUNK * 2 + 4096 * 3 + 123], ids=["empty", "small", "block", "chunks"]
)
def test_a_file_begun_from_aligned_memory_holds_it_then_the_bytes_written_after(tmp_path: Path, size: int) -> None:
    import mmap

    rng = torch.Generator().manual_seed(3)
    memory = mmap.mmap(-1, max(size, 1))  # page-aligned, as a ShardImage's memory
    head = torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).numpy().tobytes()
    memory[:size] = head
    after = [torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes() for n in (5, 5000, 70)]
    path = tmp_path / "stream.bin"
    with direct.DirectFile(path) as out:
        out.write_from(memoryview(memory)[:size])
        assert out.tell() == size
        for piece in after:
            out.write(piece)
        with pytest.raises(ValueError, match="first bytes"):
            out.write_from(memoryview(memory)[:size])
    assert path.read_bytes() == head + b"".join(after)
