"""Which modules `tiekit.shard` makes one FSDP unit each: the units asked for (or the model's
repeated blocks), merged so that the owners of every tied parameter end up in one unit.

Everything here is local and needs no process group: `shard_units` shows what `tiekit.shard`
would do.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from tiekit.analyze import find_ties
from tiekit.errors import TieError, TiekitError
from tiekit.plan import TieGroup, TiePlan, checked_plan
from tiekit.slots import checked_module, has_module, resolve

#: One entry of ``units``: a dotted name pattern ("transformer.h.*"), a module class, or a module.
UnitSpec = str | type[nn.Module] | nn.Module


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the modules one ``fully_shard`` call receives (a list when more than one)."""

    paths: tuple[str, ...]
    modules: tuple[nn.Module, ...]

    @property
    def label(self) -> str:
        """The unit's module paths, ``<root>`` for the model itself."""
        return " + ".join(p or "<root>" for p in self.paths)


class _Tree:
    """Every module of a model by path (shared modules under each of their paths) and back."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.at: dict[str, nn.Module] = {}
        self.paths: dict[int, list[str]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            self.at[path] = module
            self.paths.setdefault(id(module), []).append(path)

    def path(self, module: nn.Module) -> str:
        """The first path of ``module``."""
        return self.paths[id(module)][0]

    def strictly_inside(self, inner: nn.Module, outer: nn.Module) -> bool:
        """Whether ``outer`` is a strict ancestor of ``inner`` under any of their paths."""
        if inner is outer:
            return False
        return any(_strict_prefix(o, i) for o in self.paths[id(outer)] for i in self.paths[id(inner)])


def _strict_prefix(outer: str, inner: str) -> bool:
    return inner != outer and within(inner, outer)


def within(inner: str, outer: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or inside it ("" is the root, around everything)."""
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def _prefixes(path: str) -> Iterable[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a`` (the root "" excluded)."""
    while path:
        yield path
        path = path.rpartition(".")[0]


def innermost_unit(path: str, is_unit: Callable[[str], bool]) -> str | None:
    """The path of the innermost unit holding the module at ``path`` (itself, or the deepest of
    its enclosing modules for which ``is_unit`` holds); None: the root's unit. Local."""
    return next((prefix for prefix in _prefixes(path) if is_unit(prefix)), None)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default units: children of every ``ModuleList``/``Sequential`` whose class occurs
    more than once among its siblings and that hold parameters, outermost only (nothing inside a
    chosen block is chosen again). A child that is itself a ``ModuleList``/``ModuleDict`` (Funnel's
    blocks, lists of layers) is no unit (FSDP cannot hook a container without ``forward``): its
    own repeated children are."""
    found: dict[int, nn.Module] = {}
    stack = [model]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = [c for c in module._modules.values() if c is not None]
        chosen: list[nn.Module] = []
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(c) for c in children)
            chosen = [c for c in children if counts[type(c)] > 1 and _has_parameters(c) and not _container(c)]
            for c in chosen:
                found.setdefault(id(c), c)
        stack.extend(reversed([c for c in children if all(c is not k for k in chosen)]))
    return list(found.values())


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def resolve_units(model: nn.Module, units: Sequence[UnitSpec] | None, tree: _Tree | None = None) -> list[nn.Module]:
    """The modules ``units`` names, each once, in the order given; the root itself is left out
    (it is always the last unit). `TiekitError` for an entry that matches nothing, is not a
    submodule, or is a container FSDP cannot hook (a ``ModuleList``/``ModuleDict``)."""
    tree = tree or _Tree(model)
    if units is None:
        return repeated_blocks(model)
    if isinstance(units, (str, type, nn.Module)):
        raise TiekitError(f"units must be a list of names, classes or modules, not a single {units!r}")
    found: dict[int, nn.Module] = {}
    for spec in units:
        matched = _match(tree, spec)
        for path, module in matched:
            if module is model:
                continue
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
                raise TiekitError(
                    f"units: {spec!r} matches {path!r}, a {type(module).__name__}, which has no forward for "
                    f"FSDP to hook; name its children instead ({path + '.*'!r})"
                )
            found.setdefault(id(module), module)
    return list(found.values())


def _match(tree: _Tree, spec: UnitSpec) -> list[tuple[str, nn.Module]]:
    if isinstance(spec, str):
        pattern = spec.split(".")
        out = [
            (path, m)
            for path, m in tree.at.items()
            if path
            and len(parts := path.split(".")) == len(pattern)
            and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern, strict=True))
        ]
        what = f"the name pattern {spec!r}"
    elif isinstance(spec, type) and issubclass(spec, nn.Module):
        out = [(path, m) for path, m in tree.at.items() if isinstance(m, spec)]
        what = f"the class {spec.__name__}"
    elif isinstance(spec, nn.Module):
        out = [(tree.path(spec), spec)] if id(spec) in tree.paths else []
        what = f"the module {type(spec).__name__} (not a submodule of {type(tree.model).__name__})"
    else:
        raise TiekitError(f"units: {spec!r} is not a name pattern, a module class or a module")
    if not out:
        top = [p for p in tree.at if p and "." not in p][:8]
        raise TiekitError(
            f"units: {what} matches no module of {type(tree.model).__name__} "
            f"(its top-level modules: {', '.join(top) or 'none'}; patterns match whole dotted "
            "names, '*' within one part: 'transformer.h.*')"
        )
    return out


def shard_units(
    model: nn.Module, units: Sequence[UnitSpec] | None = None, *, plan: TiePlan | None = None
) -> list[Unit]:
    """The FSDP units `tiekit.shard` makes, in the order it wraps them; the root is last.

    ``units`` as for `tiekit.shard` (None: the model's repeated blocks). A tie whose owners fall
    in different units joins those units into one (``fully_shard([a, b])``); an owner that
    belongs to no unit joins it with its own module, and a tie held by the root module itself
    sends the units involved back to the root. A parameter a module reads outside its owner
    (``plan.cross_module``, recorded by ``find_ties(model, trace=True)``) joins the reader to the
    owner's unit the same way, unless the reader runs inside that unit already; a read by the
    root's own forward sends the owner's unit back to the root. `TieError` when the units cannot
    be ordered so that every unit is wrapped before the units around it, or when a buffer is a
    view of a parameter (FSDP replaces the parameter, so the view would stop following it).
    Local: needs no process group.
    """
    tree = _Tree(checked_module(model, "shard_units"))
    plan = find_ties(model) if plan is None else checked_plan(plan, "shard_units")
    chosen = {id(m): m for m in resolve_units(model, units, tree)}
    ties = _parameter_ties(model, plan)
    reads = _parameter_reads(tree, plan)
    _dissolve_root_ties(tree, chosen, ties + [r for r in reads if r[-1] == ""])
    outside = [r for r in reads if r[-1] != "" and not _read_inside(tree, chosen, r)]
    sets = _merge(tree, chosen, ties + outside)
    ordered = _order(tree, sets)
    result = [Unit(tuple(tree.path(m) for m in s), tuple(s)) for s in ordered]
    return [*result, Unit(("",), (model,))]


def _parameter_ties(model: nn.Module, plan: TiePlan) -> list[list[str]]:
    """Per identity group, the owning module paths of its parameter names; views of a parameter
    refused, and names the model does not have (a plan of another model)."""
    ties = []
    for group in plan.groups:
        if group.kind == "view":
            _refuse_parameter_views(group)
            continue
        names = [m.name for m in group.members if m.kind == "parameter"]
        for name in names:
            resolve(model, name, "tie plan name")
        if len(names) > 1:
            ties.append([n.rpartition(".")[0] for n in names])
    return ties


def _parameter_reads(tree: _Tree, plan: TiePlan) -> list[list[str]]:
    """Per parameter a module reads in its own forward without owning it (``plan.cross_module``,
    from ``find_ties(trace=True)``: ``F.linear(h, self.embed.weight)`` in the root), the owning
    module paths followed by the reader's path ("" for the root). FSDP gathers a parameter only
    around its own unit's forward, so the reader must run inside that unit."""
    check_reads(tree.model, plan)
    reads = []
    for use in plan.cross_module:
        group = plan.group_of(use.name)
        names = [m.name for m in group.members if m.kind == "parameter"] if group is not None else [use.name]
        names = [n for n in names if _is_parameter(tree.model, n)]  # buffers are not sharded
        if names:
            reads.append([*(n.rpartition(".")[0] for n in names), use.reader])
    return reads


def check_reads(model: nn.Module, plan: TiePlan) -> None:
    """`TieError` when a traced read of ``plan`` (``plan.cross_module``) names a weight or a reader
    module ``model`` lacks: a plan of another model. Local."""
    for use in plan.cross_module:
        resolve(model, use.name, "tie plan name")
        if not has_module(model, use.reader):
            raise TieError(
                f"tie plan reader {use.reader!r} of {use.name!r}: no such module in {type(model).__name__} "
                "(a plan of another model?)"
            )


def _is_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def _read_inside(tree: _Tree, chosen: dict[int, nn.Module], read: list[str]) -> bool:
    """Whether the reader (last path) runs inside the unit of one of the owners (the others): the
    root's unit, or one whose module contains the reader, is gathered while the reader runs."""
    *owners, reader = read
    at = tree.at[reader]
    for path in owners:
        unit = _unit_of(tree, chosen, path)
        if unit is None or chosen[unit] is at or tree.strictly_inside(at, chosen[unit]):
            return True
    return False


def _refuse_parameter_views(group: TieGroup) -> None:
    views = [m.name for m in group.members if m.view is not None]
    if any(m.kind == "parameter" for m in group.members):
        raise TieError(
            f"cannot shard {', '.join(views)}: view(s) of parameter {group.source!r}. FSDP replaces the "
            "parameter with a sharded copy, so a view of it would stop following it; compute the view "
            "in forward (e.g. self.w.t()) instead of registering it"
        )


def _unit_of(tree: _Tree, chosen: dict[int, nn.Module], path: str) -> int | None:
    """The id of the innermost chosen unit containing the module at ``path``; None: the root."""
    unit = innermost_unit(path, lambda prefix: id(tree.at[prefix]) in chosen)
    return None if unit is None else id(tree.at[unit])


def _dissolve_root_ties(tree: _Tree, chosen: dict[int, nn.Module], ties: list[list[str]]) -> None:
    """A tie one of whose owners is the root module itself can only live in the root's unit:
    the units holding its other owners go back to the root (repeated until nothing changes)."""
    changed = True
    while changed:
        changed = False
        for owners in ties:
            if "" not in owners:
                continue
            for path in owners:
                unit = _unit_of(tree, chosen, path)
                if unit is not None:
                    del chosen[unit]
                    changed = True


def _merge(tree: _Tree, chosen: dict[int, nn.Module], ties: list[list[str]]) -> list[list[nn.Module]]:
    """Units joined so that each tie's owners share one: union-find over module ids."""
    parent: dict[int, int] = {}
    modules: dict[int, nn.Module] = dict(chosen)

    def find(key: int) -> int:
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for key in chosen:
        find(key)
    for owners in ties:
        units = [_unit_of(tree, chosen, path) for path in owners]
        if len(set(units)) == 1:
            continue  # every owner in one unit already (the root included)
        keys = []
        for path, unit in zip(owners, units, strict=True):
            if unit is None:  # an owner no unit holds joins the others with its own module
                module = tree.at[path]
                modules[id(module)] = module
                unit = id(module)
            keys.append(find(unit))
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
    groups: dict[int, list[nn.Module]] = {}
    for key, module in modules.items():
        groups.setdefault(find(key), []).append(module)
    # A set's modules are its roots: a member inside another member is managed through it.
    position = {path: i for i, path in enumerate(tree.at)}
    out = []
    for members in groups.values():
        members.sort(key=lambda m: position[tree.path(m)])
        out.append([m for m in members if not any(tree.strictly_inside(m, o) for o in members)])
    return out


def _order(tree: _Tree, sets: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """Inner units before the units around them (FSDP wraps bottom-up), otherwise in
    registration order; `TieError` naming the units when no such order exists."""
    position = {path: i for i, path in enumerate(tree.at)}
    sets = sorted(sets, key=lambda s: position[tree.path(s[0])])
    owner = {id(m): i for i, s in enumerate(sets) for m in s}
    # before[i]: the sets that must be wrapped before set i (they sit inside one of its modules)
    before: list[set[int]] = [set() for _ in sets]
    for i, s in enumerate(sets):
        for m in s:
            for path in tree.paths[id(m)]:
                for prefix in [*list(_prefixes(path))[1:], ""]:
                    j = owner.get(id(tree.at[prefix]))
                    if j is not None and j != i:
                        before[j].add(i)
    done: list[int] = []
    pending = list(range(len(sets)))
    while pending:
        ready = [i for i in pending if before[i] <= set(done)]
        if not ready:
            stuck = "; ".join(" + ".join(tree.path(m) for m in sets[i]) for i in pending)
            raise TieError(
                "cannot order the FSDP units so that each is wrapped before the units around it: "
                f"{stuck}. Tied parameters join units that contain each other's modules; "
                "choose units that do not cut through the tied modules (e.g. shard their common parent)"
            )
        done.append(ready[0])
        pending.remove(ready[0])
    return [sets[i] for i in done]
