"""Values beside the tensors (optimizer options, step, ``extra``, Lightning's checkpoint entries)
as JSON plus tensors.

Tensors go beside the weights under derived keys; numbers, strings, None, lists and string-keyed
dicts are JSON; tuples, dicts with other keys, ``torch.dtype`` and ``torch.device`` get a marker
object. Anything else is refused, unless the caller passes a ``fallback`` that stores it (the
Lightning integration's opt-in pickling, for files the user trusts, is one); nothing in this
package pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tiekit.errors import CheckpointError

#: A value the codec cannot store, its key and the tensor table -> a one-key marker object
#: (``{"__pickle__": key}``) whose tensors it put in the table.
Fallback = Callable[[Any, str, dict[str, torch.Tensor]], dict[str, Any]]
#: Reads a fallback's marker back: (marker body, tensor table) -> the value.
Reader = Callable[[Any, Mapping[str, torch.Tensor]], Any]

_MARKERS = frozenset({"__tensor__", "__tuple__", "__items__", "__dtype__", "__device__", "__pickle__"})
#: Values JSON holds as they are. A list of only these is taken whole: an RNG state is thousands
#: of ints, and encoding each one alone cost a training checkpoint 2.5 ms.
_PLAIN = frozenset({int, float, str, bool, type(None)})


def encode(value: Any, key: str, tensors: dict[str, torch.Tensor], *, fallback: Fallback | None = None) -> Any:
    """JSON for ``value``, its tensors moved into ``tensors`` under keys derived from ``key``;
    ``fallback`` stores what the codec cannot (else `CheckpointError` naming ``key``)."""
    try:
        return _encode(value, key, tensors, fallback, {})
    except RecursionError:
        raise CheckpointError(f"cannot store {key!r}: its lists, tuples and dicts nest too deeply") from None


def _encode(
    value: Any, key: str, tensors: dict[str, torch.Tensor], fallback: Fallback | None, inside: dict[int, str]
) -> Any:
    """`encode`; ``inside``: the key of each container being encoded around ``value``, by id (a
    container holding itself would recurse until Python's limit)."""
    if isinstance(value, torch.Tensor):
        _refuse_unstorable(value, key)
        stored, n = key, 1
        while stored in tensors:  # {"a/b": x, "a": {"b": y}} derive one key twice: y goes under "a/b#2"
            n += 1
            stored = f"{key}#{n}"
        tensors[stored] = value.detach() if value.requires_grad else value  # a DTensor's detach costs a dispatch
        return {"__tensor__": stored}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and _PLAIN.issuperset(map(type, value)):  # in C: 10x a generator's speed
        return {"__tuple__": list(value)} if isinstance(value, tuple) else list(value)
    if isinstance(value, list | tuple | dict):
        if id(value) in inside:
            raise CheckpointError(f"cannot store {key!r}: it is {inside[id(value)]!r}, which holds it (a cycle)")
        inside[id(value)] = key
        # Encoded here, not in a helper: one frame less per level of nesting, as deep as before.
        try:
            if isinstance(value, tuple):
                return {"__tuple__": [_encode(v, f"{key}/{i}", tensors, fallback, inside) for i, v in enumerate(value)]}
            if isinstance(value, list):
                return [_encode(v, f"{key}/{i}", tensors, fallback, inside) for i, v in enumerate(value)]
            if all(isinstance(k, str) for k in value) and not _MARKERS & set(value):
                return {k: _encode(v, f"{key}/{k}", tensors, fallback, inside) for k, v in value.items()}
            items = [
                [_encode(k, f"{key}/<key {i}>", tensors, fallback, inside),
                 _encode(v, f"{key}/<value {i}>", tensors, fallback, inside)]
                for i, (k, v) in enumerate(value.items())
            ]  # fmt: skip
            return {"__items__": items}
        finally:
            del inside[id(value)]
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if fallback is not None:
        return fallback(value, key, tensors)
    raise CheckpointError(
        f"cannot store {key!r}: a {type(value).__name__} (tiekit stores tensors, numbers, strings, None, dtypes, "
        "devices, and lists, tuples and dicts of these; it never pickles)"
    )


def _refuse_unstorable(tensor: torch.Tensor, key: str) -> None:
    """`CheckpointError` naming ``key`` for a tensor no checkpoint can hold: no data (meta), or not
    dense (sparse), which failed later as torch's own error deep inside the copy to the host."""
    if tensor.is_meta:
        raise CheckpointError(f"cannot store {key!r}: a tensor on the meta device (it has no data)")
    if tensor.layout != torch.strided:
        raise CheckpointError(
            f"cannot store {key!r}: a {tensor.layout} tensor (checkpoints store dense tensors: .to_dense() it)"
        )


def decode(
    value: Any, tensors: Mapping[str, torch.Tensor], where: str, *, readers: Mapping[str, Reader] | None = None
) -> Any:
    """The value `encode` stored as ``value``; ``readers`` read a fallback's markers back.
    `CheckpointError` naming ``where`` if the metadata is malformed."""

    def tensor(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(f"{where}: the checkpoint metadata names key {key!r}, which the file lacks")
        return tensors[key]

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1 and next(iter(v)) in _MARKERS:
            ((marker, body),) = v.items()
            if readers and marker in readers:
                return readers[marker](body, tensors)
            return _unmark(marker, body, tensor, walk, where)
        return {k: walk(x) for k, x in v.items()}

    return walk(value)


def _unmark(marker: str, body: Any, tensor: Callable[[Any], Any], walk: Callable[[Any], Any], where: str) -> Any:
    if marker == "__tensor__":
        return tensor(body)
    if marker == "__tuple__" and isinstance(body, list):
        return tuple(walk(x) for x in body)
    if marker == "__items__" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        pairs = [(walk(k), walk(x)) for k, x in body]
        try:
            return dict(pairs)
        except TypeError as exc:  # a key that cannot be a dict key
            raise CheckpointError(f"{where}: corrupted checkpoint metadata (a dict key): {exc}") from exc
    if marker == "__dtype__" and isinstance(body, str) and isinstance(getattr(torch, body, None), torch.dtype):
        return getattr(torch, body)
    if marker == "__device__" and isinstance(body, str):
        try:
            return torch.device(body)
        except RuntimeError as exc:
            raise CheckpointError(f"{where}: corrupted checkpoint metadata (device {body!r}): {exc}") from exc
    if marker == "__pickle__":
        raise CheckpointError(
            f"{where}: holds a pickled value, which this loader does not read (tiekit never unpickles)"
        )
    raise CheckpointError(f"{where}: corrupted checkpoint metadata ({marker} with {type(body).__name__})")
