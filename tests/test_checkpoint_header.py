"""The safetensors header parser: hand-made bad files, then hypothesis against safetensors itself.

Whatever the bytes, `parse_header` either raises `CheckpointError` or accepts a header that
safetensors' own reader also accepts, with the same tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load, save

from tiekit import CheckpointError
from tiekit.header import MAX_HEADER_BYTES, parse_header, read_header

VALID = save(
    {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 2, 3], dtype=torch.int16),
        "c": torch.zeros(0),
        "d": torch.tensor(True),
        "e": torch.ones(2, dtype=torch.bfloat16),
    },
    metadata={"format": "pt", "note": "x"},
)
# dtypes safetensors' torch binding reads too (it does not map F8_E8M0), so both can be compared
CODES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def file_bytes(header: object, data: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def agree_with_safetensors(data: bytes) -> None:
    """Ours accepts => safetensors accepts, with the same names, dtypes, shapes and bytes."""
    try:
        header = parse_header(data)
    except CheckpointError as exc:
        assert "<bytes>" in str(exc)  # the message names the file
        return
    theirs = load(data)
    assert set(theirs) == set(header.entries)
    for name, entry in header.entries.items():
        tensor = theirs[name]
        assert (tensor.dtype, tuple(tensor.shape)) == (entry.dtype, entry.shape)
        assert tensor.reshape(-1).view(torch.uint8).numpy().tobytes() == data[entry.start : entry.end]


def test_valid_file_is_read_with_absolute_offsets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "x.safetensors"
    path.write_bytes(VALID)
    header = read_header(path)
    assert header.metadata == {"format": "pt", "note": "x"}
    assert header.path == str(path) and header.file_size == len(VALID)
    a = header.entries["a"]
    assert (a.dtype, a.shape, a.end - a.start) == (torch.float32, (2, 3), 24)
    assert torch.equal(
        torch.frombuffer(bytearray(VALID[a.start : a.end]), dtype=torch.float32).reshape(2, 3), load(VALID)["a"]
    )


ONE = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated: 0 byte"),
        (VALID[:5], "truncated: 5 byte"),
        (VALID[:40], "truncated: the header claims"),
        (VALID[:-1], "truncated: key"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "oversized header"),
        (struct.pack("<Q", 2**64 - 1), "oversized header"),
        (file_bytes("{not json", b""), "not UTF-8 JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8 JSON"),
        (file_bytes("[]"), "instead of an object"),
        (file_bytes('{"a":' + json.dumps(ONE) + ',"a":' + json.dumps(ONE) + "}", b"\0" * 4), "'a' appears twice"),
        (file_bytes({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "at key 'a': expected dtype"),
        (file_bytes({"a": {**ONE, "dtype": "F7"}}, b"\0" * 4), "key 'a' has dtype 'F7'"),
        (file_bytes({"a": {**ONE, "shape": [-1]}}, b"\0" * 4), "key 'a' has an invalid shape"),
        (file_bytes({"a": {**ONE, "shape": [True]}}, b"\0" * 4), "key 'a' has an invalid shape"),
        (file_bytes({"a": {**ONE, "data_offsets": [0]}}, b"\0" * 4), "key 'a' has invalid data_offsets"),
        (file_bytes({"a": {**ONE, "shape": [2]}}, b"\0" * 4), "offsets lie at key 'a': 4 byte(s)"),
        (file_bytes({"a": {**ONE, "data_offsets": [4, 8]}}, b"\0" * 8), "offsets lie at key 'a'"),
        (file_bytes({"a": ONE, "b": ONE}, b"\0" * 4), "offsets lie at key 'b'"),
        (file_bytes({"a": ONE}, b"\0" * 8), "4 unexpected byte(s) after the last tensor"),
        (file_bytes({"a": {**ONE, "data_offsets": [0, 2**70]}}, b"\0" * 4), "offsets lie at key 'a'"),
        (file_bytes({"__metadata__": {"k": 1}, "a": ONE}, b"\0" * 4), "'__metadata__' must map strings"),
    ],
)
def test_bad_headers_raise_checkpoint_error_naming_file_and_key(data: bytes, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        parse_header(data, where="bad.safetensors")
    assert str(info.value).startswith("bad.safetensors: ")
    assert message in str(info.value)


def test_a_torch_save_file_is_named_as_one(tmp_path: Path) -> None:
    # The zip signature read as a header length gave "oversized header (578712552184433488 bytes".
    torch.save({"w": torch.ones(2)}, tmp_path / "zip.ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name, kind in (("zip.ckpt", "a zip archive, as torch.save writes"), ("legacy.pt", "a Python pickle")):
        with pytest.raises(CheckpointError, match=f"{name}: not a safetensors file: it starts as {kind}"):
            parse_header((tmp_path / name).read_bytes(), where=str(tmp_path / name))


def test_unknown_fields_are_ignored_like_safetensors_does() -> None:
    data = file_bytes({"a": {**ONE, "extra": 1}}, b"\0" * 4)
    assert parse_header(data).entries["a"].shape == (1,)
    assert load(data)["a"].shape == (1,)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, len(VALID)),
)
def test_fuzz_byte_mutations_and_truncations(flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    agree_with_safetensors(bytes(data))
    agree_with_safetensors(bytes(data[:cut]))


def tensor_infos() -> st.SearchStrategy[dict[str, object]]:
    code = st.sampled_from(sorted(CODES))
    shape = st.lists(st.integers(0, 3), max_size=3)
    return st.fixed_dictionaries({"dtype": code, "shape": shape})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text(min_size=1, max_size=4), tensor_infos(), max_size=4),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    st.lists(st.integers(-2, 2), min_size=8, max_size=8),
    st.integers(0, 3),
    st.booleans(),
)
def test_fuzz_generated_headers_agree_with_safetensors(
    infos: dict[str, dict[str, object]], metadata: dict[str, str], lies: list[int], slack: int, pad: bool
) -> None:
    """Headers laid out like safetensors' own, then offsets shifted by small lies: accepted
    exactly when safetensors accepts them, and then with the same tensors."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    position = 0
    for i, (name, info) in enumerate(infos.items()):
        size = CODES[str(info["dtype"])]
        for d in info["shape"]:  # type: ignore[attr-defined]
            size *= d
        header[name] = {**info, "data_offsets": [position + lies[2 * i], position + size + lies[2 * i + 1]]}
        position += size
    text = json.dumps(header) + (" " * 7 if pad else "")
    data = file_bytes(text, bytes(range(256))[: max(0, position + slack - 1)])
    try:
        ours: object = parse_header(data)
    except CheckpointError:
        ours = None
    try:
        theirs: object = load(data)
    except (SafetensorError, ValueError, RuntimeError, KeyError, OverflowError):  # safetensors refused it
        theirs = None
    assert (ours is None) == (theirs is None), (text, ours, theirs)
    agree_with_safetensors(data)
