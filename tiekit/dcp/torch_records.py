"""Tensor records as ``torch.save`` writes them, from one template per tensor layout.

DCP stores each tensor of a shard file as a ``torch.save`` record (a small zip archive).
Checksums are off while shard files are written (`records_without_checksums`; ``torch.load``
never checks them), and without them a record's bytes depend on the tensor's dtype, shape and
strides, never on its values: a fixed prefix, the tensor's bytes, a fixed suffix (the tests
compare them with ``torch.save``'s own, record by record). ``torch.save`` pickles the tensor and
hands its zip headers over in about 40 writes per record: 60-80 µs of Python, which a background
save takes from the training thread (it waits for the GIL). From its template a record is three
writes. A layout's template is what ``torch.save`` wrote the first time, split around the
tensor's bytes, which are found by their address; ``torch.save`` writes every record that has no
template (checksums on, an empty tensor, anything but a plain dense host tensor owning exactly
its storage).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

_checksums_lock = threading.Lock()
_writers_without_checksums = 0
_checksums_before = True


@contextmanager
def records_without_checksums() -> Iterator[None]:
    """``torch.save`` writes no CRC32 while any block of this kind runs in the process; the option
    is set back to what it was when the last one ends."""
    global _writers_without_checksums, _checksums_before
    if not hasattr(torch.serialization, "set_crc32_options"):  # torch < 2.6 always writes them
        yield
        return
    with _checksums_lock:
        if _writers_without_checksums == 0:
            _checksums_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _writers_without_checksums += 1
    try:
        yield
    finally:
        with _checksums_lock:
            _writers_without_checksums -= 1
            if _writers_without_checksums == 0:
                torch.serialization.set_crc32_options(_checksums_before)


# (prefix, suffix) by layout; None for a layout whose bytes could not be found in its record.
_templates: dict[tuple[Any, ...], tuple[bytes, bytes] | None] = {}
_templates_lock = threading.Lock()
_MAX_TEMPLATES = 4096  # a model has a few hundred layouts; the bound only stops unbounded growth
_UNSEEN = object()


def write_record(stream: Any, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (on the host) to ``stream`` as ``torch.save(tensor, stream)`` would."""
    key = layout_of(tensor)
    template = None if key is None else _templates.get(key, _UNSEEN)
    if template is _UNSEEN:
        assert key is not None
        _capture(key, tensor, stream)
        return
    if template is None:
        torch.save(tensor, stream)
        return
    assert isinstance(template, tuple)
    prefix, suffix = template
    stream.write(prefix)
    stream.write(_storage_bytes(tensor))
    stream.write(suffix)


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t``'s storage in memory order, as torch.save writes them (a transposed
    tensor's are not in its row-major order)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def layout_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What a record of ``t`` depends on besides its values (dtype, shape, strides, torch's
    storage alignment); None where a template cannot stand for ``torch.save`` (checksums on: they
    depend on the values; or the pickle would hold more than this)."""
    if (
        type(t) is not torch.Tensor
        or t.layout != torch.strided
        or t.device.type != "cpu"
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or t.__dict__
        or not t.nbytes
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.nbytes
        or _checksums_on()
    ):
        return None
    return (t.dtype, tuple(t.shape), t.stride(), _storage_alignment())


def _checksums_on() -> bool:
    options = getattr(torch.serialization, "get_crc32_options", None)
    return options is None or bool(options())  # torch < 2.6 always writes them


def _storage_alignment() -> int:
    config = getattr(torch.serialization, "config", None)
    return int(getattr(getattr(config, "save", None), "storage_alignment", 64))


def record_template(shape: torch.Size, dtype: torch.dtype) -> tuple[tuple[Any, ...], bytes, bytes] | None:
    """(layout, prefix, suffix) of the record of a new contiguous tensor of ``shape`` and
    ``dtype`` written without checksums (`layout_of` it), made the first time by ``torch.save``
    of untouched memory into no file (its bytes are never read); None where a template cannot
    stand for ``torch.save``."""
    tensor = torch.empty(shape, dtype=dtype)
    with records_without_checksums():
        key = layout_of(tensor)
        if key is None:
            return None
        if key not in _templates:
            _capture(key, tensor, None)
    template = _templates.get(key)
    return None if template is None else (key, *template)


def _capture(key: tuple[Any, ...], tensor: torch.Tensor, stream: Any) -> None:
    """``torch.save`` the tensor into ``stream``, keeping what it wrote around the tensor's bytes
    as the layout's template."""
    recording = _Recording(stream, tensor)
    torch.save(tensor, recording)  # type: ignore[arg-type]  # a binary stream, as torch.save takes
    template = recording.template()
    with _templates_lock:
        if len(_templates) < _MAX_TEMPLATES:
            _templates[key] = template


class _Recording(io.RawIOBase):
    """A stream passing every write on to ``stream`` (None: nowhere), keeping the bytes written
    before and after the one write of ``tensor``'s own memory."""

    def __init__(self, stream: Any, tensor: torch.Tensor) -> None:
        super().__init__()
        self._stream = stream
        self._address = tensor.data_ptr()
        self._nbytes = tensor.nbytes
        self._pieces: list[bytes] = []
        self._data_at: list[int] = []  # where in the pieces the tensor's bytes were written

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes == self._nbytes and _address(view) == self._address:
            self._data_at.append(len(self._pieces))
        else:
            self._pieces.append(bytes(view))
        if self._stream is not None:
            self._stream.write(view)
        return view.nbytes

    def template(self) -> tuple[bytes, bytes] | None:
        if len(self._data_at) != 1:
            return None
        at = self._data_at[0]
        return b"".join(self._pieces[:at]), b"".join(self._pieces[at:])


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
