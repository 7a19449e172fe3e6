"""`TiePlan`: an immutable, serializable record of which names alias which tensor.

A plan is made by :func:`tiekit.find_ties` before a move and applied by
:func:`tiekit.retie` after it. Checkpoints embed its JSON, so the format is versioned:
``from_dict`` accepts every version up to :data:`PLAN_VERSION` and refuses newer ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tiekit.errors import TieError

PLAN_VERSION = 1
"""The tie plan format version this tiekit writes (the ``"version"`` of `TiePlan.to_dict`); newer ones are refused."""

GroupKind = Literal["parameter", "buffer", "view"]
MemberKind = Literal["parameter", "buffer"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as plans and error messages spell dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ViewGeometry:
    """Where a view member sits inside its group's source.

    ``offset`` is counted in elements from the source's first element, so the view can be
    rebuilt on any device as ``source.as_strided(size, stride, source.storage_offset() + offset)``.
    """

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def end(self) -> int:
        """One past the last source element the view reaches (``offset`` + `strided_extent`)."""
        return self.offset + strided_extent(self.size, self.stride)

    def view_of(self, source: torch.Tensor) -> torch.Tensor:
        """This view of ``source`` (its group's source tensor)."""
        return source.as_strided(self.size, self.stride, source.storage_offset() + self.offset)


def strided_extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a strided tensor's first element to its last, inclusive (for ``size`` and
    ``stride`` of non-negative entries); 0 for an empty tensor, which reaches no element."""
    if 0 in size:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))


@dataclass(frozen=True)
class TieMember:
    """One name in a tie group: a parameter or buffer slot, and how it relates to the source.

    ``view is None`` means the slot holds the very same tensor object as the source.
    """

    name: str
    kind: MemberKind
    view: ViewGeometry | None = None
    requires_grad: bool = False


@dataclass(frozen=True)
class TieUse:
    """A place in a traced graph that reads a tied tensor.

    ``op`` is the fx node op (``"call_module"`` or ``"get_attr"``), ``target`` the node's target
    and ``module`` the path of the module whose ``forward`` performs the read ("" for the root).
    """

    op: str
    target: str
    module: str


@dataclass(frozen=True)
class CrossModuleUse:
    """A tensor read by a module that does not own any of its names (FSDP/pipeline must keep them together)."""

    name: str
    reader: str


@dataclass(frozen=True)
class ReinterpretingView:
    """A tensor over a group source's memory in another dtype (``w.detach().view(torch.int32)``).

    No group can hold it: a view is rebuilt from its source with ``as_strided``, in the source's
    dtype. `tiekit.move`, `tiekit.preserve_ties` and `tiekit.TPUMixin` refuse to convert a model
    with one, which would leave ``name`` a tensor of its own, no longer sharing ``source``'s memory.
    """

    name: str
    source: str
    dtype: str
    source_dtype: str


@dataclass(frozen=True)
class TieGroup:
    """Names that must refer to one tensor (or to views of one tensor) after every move."""

    source: str
    members: tuple[TieMember, ...]
    kind: GroupKind
    shape: tuple[int, ...]
    dtype: str
    uses: tuple[TieUse, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """All member names, source first."""
        return tuple(m.name for m in self.members)

    def member(self, name: str) -> TieMember:
        """The member called ``name``; `TieError` if it is not in this group."""
        for m in self.members:
            if m.name == name:
                return m
        raise TieError(f"{name!r} is not a member of the tie group of {self.source!r}")


@dataclass(frozen=True)
class TiePlan:
    """Every tie group of a model, plus the parameter counts a verified move must reproduce.

    ``unique_count`` is the number of distinct parameter tensors (``len(list(model.parameters()))``
    once the plan is applied) and ``total_count`` the number of parameter names.
    ``reinterpreting`` lists the views in another dtype that a move refuses; it describes the
    model in memory, is not part of the JSON (a checkpoint stores such a tensor by itself; `move`
    and `preserve_ties` given a plan without them look in the model) and not compared.
    """

    groups: tuple[TieGroup, ...]
    unique_count: int
    total_count: int
    suspected: tuple[tuple[str, ...], ...] = ()
    cross_module: tuple[CrossModuleUse, ...] = ()
    trace_status: str = "not traced"
    reinterpreting: tuple[ReinterpretingView, ...] = field(default=(), compare=False)
    _index: Mapping[str, TieGroup] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, TieGroup] = {}
        for group in self.groups:
            for name in group.names:
                if name in index and index[name] is group:
                    raise TieError(f"{name!r} is listed twice in the tie group of {group.source!r}")
                if name in index:
                    raise TieError(f"{name!r} is in two tie groups ({index[name].source!r} and {group.source!r})")
                index[name] = group
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[TieGroup]:
        return iter(self.groups)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @property
    def tied_names(self) -> tuple[str, ...]:
        """Every name that is not its group's source: the names a de-duplicated file omits."""
        return tuple(n for g in self.groups for n in g.names[1:])

    def group_of(self, name: str) -> TieGroup | None:
        """The group ``name`` belongs to, or None if it is not tied."""
        return self._index.get(name)

    def source_of(self, name: str) -> str:
        """The source name of ``name``'s group; an untied name is its own source."""
        group = self._index.get(name)
        return name if group is None else group.source

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, tagged with :data:`PLAN_VERSION`."""
        return {
            "version": PLAN_VERSION,
            "unique_count": self.unique_count,
            "total_count": self.total_count,
            "trace_status": self.trace_status,
            "groups": [
                {
                    "source": g.source,
                    "kind": g.kind,
                    "shape": list(g.shape),
                    "dtype": g.dtype,
                    "members": [_member_to_dict(m) for m in g.members],
                    "uses": [[u.op, u.target, u.module] for u in g.uses],
                }
                for g in self.groups
            ],
            "suspected": [list(s) for s in self.suspected],
            "cross_module": [[c.name, c.reader] for c in self.cross_module],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TiePlan:
        """Rebuild a plan from :meth:`to_dict` output; `TieError` on anything malformed."""
        try:
            version = data["version"]
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise TieError(f"tie plan: field 'version' is {version!r}, not a positive integer")
            if version > PLAN_VERSION:
                raise TieError(
                    f"tie plan version {version} is newer than this tiekit understands ({PLAN_VERSION}); upgrade tiekit"
                )
            groups = tuple(_group_from_dict(g) for g in _list(data["groups"], "field 'groups'"))
            return cls(
                groups=groups,
                unique_count=_count(data["unique_count"], "field 'unique_count'"),
                total_count=_count(data["total_count"], "field 'total_count'"),
                suspected=_string_lists(data.get("suspected", []), None, "field 'suspected'"),
                cross_module=tuple(
                    CrossModuleUse(*c) for c in _string_lists(data.get("cross_module", []), 2, "field 'cross_module'")
                ),
                trace_status=_str(data.get("trace_status", "not traced")),
            )
        except TieError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TieError(f"malformed tie plan: {type(exc).__name__}: {exc}") from exc

    def to_json(self) -> str:
        """Compact, key-sorted JSON (stable bytes for the same plan)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> TiePlan:
        """Inverse of :meth:`to_json`; `TieError` on invalid JSON or content."""
        try:
            data = json.loads(text)
        # RecursionError: json's decoder recurses once per nesting level, and a file's
        # metadata can nest deeper than the interpreter's stack allows.
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise TieError(f"tie plan is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise TieError("tie plan JSON must be an object")
        return cls.from_dict(data)

    def __str__(self) -> str:
        header = ("source", "kind", "shape", "dtype", "tied names")
        rows = [
            (g.source, g.kind, "x".join(map(str, g.shape)) or "scalar", g.dtype, ", ".join(g.names[1:]))
            for g in self.groups
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        lines = [
            f"TiePlan: {len(self.groups)} group(s), {self.unique_count} unique parameter(s) "
            f"under {self.total_count} name(s)"
        ]
        for r in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4])
        if self.suspected:
            lines.append("suspected broken ties (distinct tensors, identical values):")
            lines.extend("  " + ", ".join(s) for s in self.suspected)
        if self.reinterpreting:
            lines.append("views in another dtype (a move refuses them):")
            lines.extend(f"  {r.name} ({r.dtype}) over {r.source} ({r.source_dtype})" for r in self.reinterpreting)
        if self.cross_module:
            lines.append("read outside their owner:")
            lines.extend(f"  {c.name} by {c.reader or '<root>'}" for c in self.cross_module)
        return "\n".join(lines)


def _member_to_dict(m: TieMember) -> dict[str, Any]:
    out: dict[str, Any] = {"name": m.name, "kind": m.kind}
    if m.view is not None:
        out["view"] = {"offset": m.view.offset, "size": list(m.view.size), "stride": list(m.view.stride)}
        out["requires_grad"] = m.requires_grad
    return out


def _group_from_dict(g: Mapping[str, Any]) -> TieGroup:
    source = _str(g["source"])
    where = f"tie group {source!r}"
    members = tuple(_member_from_dict(m) for m in _list(g["members"], f"{where}: field 'members'"))
    if not members or members[0].name != source:
        raise TieError(f"{where}: the source must be the first member")
    return TieGroup(
        source=source,
        kind=_kind(g["kind"], ("parameter", "buffer", "view")),  # type: ignore[arg-type]
        shape=_sizes(g["shape"], f"{where}: field 'shape'"),
        dtype=_dtype(g["dtype"], f"{where}: field 'dtype'"),
        members=members,
        uses=tuple(TieUse(*u) for u in _string_lists(g.get("uses", []), 3, f"{where}: field 'uses'")),
    )


def _member_from_dict(d: Mapping[str, Any]) -> TieMember:
    name = _str(d["name"])
    view = d.get("view")
    geometry = None
    if view is not None:
        # Refused here, when the plan is read: torch's as_strided would refuse a negative
        # stride only while retie rebuilds the view, after a load has overwritten the model.
        where = f"view member {name!r}: field"
        geometry = ViewGeometry(
            _count(view["offset"], f"{where} 'offset'"),
            _sizes(view["size"], f"{where} 'size'"),
            _sizes(view["stride"], f"{where} 'stride'"),
        )
        if len(geometry.size) != len(geometry.stride):
            raise TieError(f"view member {name!r}: size and stride differ in length")
    return TieMember(
        name=name,
        kind=_kind(d["kind"], ("parameter", "buffer")),  # type: ignore[arg-type]
        view=geometry,
        requires_grad=_flag(d.get("requires_grad", False), f"member {name!r}: field 'requires_grad'"),
    )


# ``what`` names the field for the error: "field 'groups'", "tie group 'w': field 'shape'".


def _list(value: Any, what: str) -> list[Any] | tuple[Any, ...]:
    # A JSON object here would iterate as its keys: "groups": {} would read as an empty plan.
    if not isinstance(value, list | tuple):
        raise TieError(f"tie plan: {what} is {value!r}, not a list")
    return value


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TieError(f"tie plan: {what} is {value!r}, not a non-negative integer")
    return value


def _sizes(values: Any, what: str) -> tuple[int, ...]:
    """A shape, size or stride: a list of non-negative integers."""
    return tuple(_count(v, what) for v in _list(values, what))


def _dtype(value: Any, what: str) -> str:
    """A dtype as `dtype_name` spells it ("float32").

    A name torch does not know is refused, and so is an alias ("float", "half"): checkpoints
    compare the plan's dtype with the stored tensor's ``dtype_name``, which never spells one.
    """
    name = _str(value)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TieError(f"tie plan: {what} is {name!r}, not a torch dtype")
    canonical = dtype_name(dtype)
    if name != canonical:
        raise TieError(f"tie plan: {what} is {name!r}, an alias of torch.{canonical}; plans spell it {canonical!r}")
    return name


def _string_lists(value: Any, length: int | None, what: str) -> tuple[tuple[str, ...], ...]:
    """A list of lists of strings (each of exactly ``length`` unless None): suspected names, uses.

    A bare string is refused at either level: iterated, "ab" would read as the names "a" and "b".
    """
    entries = _list(value, what)
    for entry in entries:
        if (
            not isinstance(entry, list | tuple)
            or (length is not None and len(entry) != length)
            or not all(isinstance(item, str) for item in entry)
        ):
            count = "" if length is None else f"{length} "
            raise TieError(f"tie plan: {what} has an entry {entry!r}, not a list of {count}strings")
    return tuple(tuple(entry) for entry in entries)


def _flag(value: Any, what: str) -> bool:
    # bool("false") is True: only a JSON boolean says what to_dict wrote.
    if not isinstance(value, bool):
        raise TieError(f"tie plan: {what} is {value!r}, not true or false")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _kind(value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"kind {value!r} is not one of {allowed}")
    return str(value)


def checked_plan(plan: object, where: str = "") -> TiePlan:
    """``plan`` if it is a `TiePlan`; `TieError` naming ``where`` (a function) otherwise."""
    if not isinstance(plan, TiePlan):
        raise TieError(
            f"{where + ': ' if where else ''}plan must be a TiePlan (tiekit.find_ties(model), or TiePlan.from_json), "
            f"not a {type(plan).__name__}"
        )
    return plan
