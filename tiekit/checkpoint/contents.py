"""What a tied checkpoint stores: the plan (the model's ties, and the declared ones its tensors
still agree with), one tensor per tie group, host copies safetensors accepts, the header, and a
training checkpoint's tensors and record. Local; `CheckpointError` on what cannot be stored."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import find_ties
from tiekit.checkpoint.codec import Fallback, encode
from tiekit.checkpoint.deferred import local_part
from tiekit.checkpoint.layout import PLAN_KEY, nbytes
from tiekit.checkpoint.optimizer import optimizer_record
from tiekit.errors import CheckpointError, TieError
from tiekit.header import DTYPE_CODES
from tiekit.mixin import TPUMixin
from tiekit.plan import TiePlan
from tiekit.retie import tie_changes
from tiekit.slots import resolve


def saving_plan(model: nn.Module) -> TiePlan:
    """The model's ties, plus the declared ties that hold in its current tensors.

    A declared tie whose two tensors differ (a tie broken by a move, then trained) is left
    out: dropping one of them would lose data. The file then records two tensors.
    """
    declared = declared_ties_holding(model)
    try:
        plan = find_ties(model, declared=declared or None)
    except TieError as exc:
        raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    return stored_only(plan, set(model.state_dict(keep_vars=True)))


def stored_only(plan: TiePlan, stored: set[str]) -> TiePlan:
    """``plan`` without the names the file does not store (non-persistent buffers, such as a
    rotary ``inv_freq`` one module shares with every layer): a group records the names that
    read its stored tensor. A group whose source is not stored goes whole (its views are
    relative to it); its stored members are then saved each under its own name."""
    groups = []
    for group in plan.groups:
        if group.source not in stored:
            continue
        members = tuple(m for m in group.members if m.name in stored)
        if len(members) > 1:
            groups.append(group if len(members) == len(group.members) else replace(group, members=members))
    if len(groups) == len(plan.groups):
        return plan
    return replace(plan, groups=tuple(groups))


def model_ties(model: nn.Module) -> TiePlan:
    """The ties of ``model``: those it holds (`find_ties`) and all it declares (`declared_ties`),
    holding or not. What a load re-ties, and what a sharded save checks FSDP2 keeps as one tensor
    (`tiekit.sharding.check.refuse_split_model_ties`). Local; `TieError` as `find_ties` raises it."""
    return find_ties(model, declared=declared_ties(model) or None)


def declared_ties_holding(model: nn.Module) -> dict[str, str]:
    """The model's declared ties (`declared_ties`) whose two tensors are one, or equal in value:
    a tie a plain move broke, not one trained apart (tying those would lose data). Local."""
    return {t: s for t, s in declared_ties(model).items() if _same_values(model, t, s)}


def _same_values(model: nn.Module, target: str, source: str) -> bool:
    a, b = resolve(model, target)[2], resolve(model, source)[2]
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta or a.device != b.device:
        return False
    if getattr(a, "placements", None) != getattr(b, "placements", None):
        return False  # sharded differently (or one not at all): kept apart, nothing lost
    # Local: torch.equal of two DTensors is an all-reduce, which a rank whose tie alone is broken
    # would start by itself (every other rank found the tie whole), and wait in for good. Each
    # rank compares its shards; ranks that conclude differently save different plans, which the
    # sharded save refuses on every rank.
    with torch.no_grad():
        return bool(torch.equal(local_part(a), local_part(b)))


def declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model and its submodules declare: ``TPUMixin.tied_weights``
    and transformers' ``_tied_weights_keys`` (restricted to names that exist in the model):
    transformers 5's expanded ``{target: source}``, or transformers 4's list of targets
    (`transformers4_ties`). A submodule's are named from ``model`` (a LightningModule holding a
    ``GPT2LMHeadModel`` as ``self.model`` declares ``model.lm_head.weight``); where two modules
    declare one target, the outermost's holds. A ``tied_weights`` name that does not resolve is a
    `CheckpointError`, as it is a `TieError` when the module moves. Through ``torch.compile``'s
    wrapper, the wrapped model's, under its ``_orig_mod.`` names (the wrapper forwards the
    attribute, but its names carry the prefix)."""
    declared: dict[str, str] = {}
    expanded: list[str] = []  # transformers 5 models, each read with its submodels: their prefixes
    for path, module in model.named_modules() if isinstance(model, nn.Module) else ():
        prefix = f"{path}." if path else ""
        if _compile_wrapper(module):
            continue  # it forwards the wrapped model's attributes, whose names lack "_orig_mod."
        if isinstance(module, TPUMixin):  # before its transformers declarations: tied_weights wins
            for target, source in _mixin_ties(module).items():
                declared.setdefault(prefix + target, prefix + source)
        expand = _own_method(module, "get_expanded_tied_weights_keys")
        if expand is not None and not any(prefix.startswith(e) for e in expanded):
            expanded.append(prefix)
            with contextlib.suppress(TypeError, AttributeError, KeyError, ValueError, RuntimeError):
                found = expand(all_submodels=True)  # its submodels' own, with their prefixes
                if isinstance(found, Mapping):
                    for t, s in found.items():
                        if isinstance(t, str) and isinstance(s, str):
                            declared.setdefault(prefix + t, prefix + s)
    if "" not in expanded:  # transformers 4 models, each read by transformers4_ties's own walk
        for target, source in transformers4_ties(model).items():
            declared.setdefault(target, source)
    out = {}
    for target, source in declared.items():
        try:
            a, b = resolve(model, target)[2], resolve(model, source)[2]
        except TieError:
            continue
        if a.shape == b.shape and a.dtype == b.dtype:
            out[target] = source
    return out


def _own_method(module: nn.Module, name: str) -> Any:
    """``module``'s bound method ``name`` when its class defines it, else None: a wrapper that
    forwards attributes (peft's PeftModel, FSDP1) lends the wrapped model's, whose names lack the
    wrapper's path (the wrapped model is met below it, under its own)."""
    return getattr(module, name) if callable(getattr(type(module), name, None)) else None


def _compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper: the wrapped model alone, as ``_orig_mod``."""
    inner = module._modules.get("_orig_mod")
    return inner is not None and len(module._modules) == 1 and not module._parameters and not module._buffers


def _mixin_ties(module: TPUMixin) -> Mapping[str, str]:
    """``module.tied_weights``, each name checked to resolve in ``module`` (`CheckpointError`)."""
    assert isinstance(module, nn.Module)
    for target, source in module.tied_weights.items():
        if not isinstance(target, str) or not isinstance(source, str):
            raise CheckpointError(f"{type(module).__name__}.tied_weights maps names to names; got {target!r}")
        try:
            resolve(module, target, "declared tie target (tied_weights)")
            resolve(module, source, "declared tie source (tied_weights)")
        except TieError as exc:
            raise CheckpointError(f"{type(module).__name__}: {exc}") from exc
    return module.tied_weights


def transformers4_ties(model: nn.Module, *, by_config: bool = True) -> dict[str, str]:
    """``{target: source}`` ties a transformers 4.x model declares, as its ``tie_weights`` makes
    them in each (sub)model: the names its class lists in ``_tied_weights_keys`` take the input
    embedding's weight, when the (text decoder) config ties word embeddings (the default; with
    ``torchscript`` it clones instead); with ``is_encoder_decoder`` and ``tie_encoder_decoder``
    each encoder weight and bias takes its decoder counterpart's (a transformers 5 model among
    them is left out: it expands its own). ``by_config=False``: the
    embedding ties the classes declare whatever the config says. Names relative to ``model``;
    those that do not exist are left for the caller to drop."""
    ties: dict[str, str] = {}
    if not isinstance(model, nn.Module):
        return ties  # not a model: the caller's own check names what it is
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        # Its own config: a wrapper forwarding attributes (peft's PeftModel) would lend the wrapped
        # model's, whose names lack the wrapper's path; the wrapped model is met below it.
        config = vars(module).get("config")
        if config is None or _own_method(module, "get_expanded_tied_weights_keys") is not None:
            continue  # a transformers 5 model declares its own ties, expanded (`declared_ties`)
        pairs = dict(_embedding_ties(module)) if not by_config or _ties_word_embeddings(config) else {}
        if by_config and getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False):
            pairs.update(_encoder_decoder_ties(module))
        for target, source in pairs.items():
            ties.setdefault(prefix + target, prefix + source)  # an outer model's declaration first
    return ties


def _ties_word_embeddings(config: Any) -> bool:
    text = config
    with contextlib.suppress(TypeError, AttributeError, ValueError):
        text = config.get_text_config(decoder=True)
    return bool(getattr(text, "tie_word_embeddings", True)) and not getattr(config, "torchscript", False)


def _embedding_ties(module: nn.Module) -> list[tuple[str, str]]:
    """The targets ``module`` lists in a 4.x ``_tied_weights_keys``, each with the input
    embedding's weight as source (named by identity; not one of the targets, which may already
    be that tensor)."""
    targets = getattr(module, "_tied_weights_keys", None)
    get_input_embeddings = getattr(module, "get_input_embeddings", None)
    if not isinstance(targets, (list, tuple)) or not callable(get_input_embeddings):
        return []
    try:
        weight = getattr(get_input_embeddings(), "weight", None)
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return []
    if not isinstance(weight, torch.Tensor):
        return []
    names = dict(module.named_parameters(remove_duplicate=False))
    source = next((n for n, p in names.items() if p is weight and n not in targets), None)
    if source is None:
        return []
    return [(t, source) for t in targets if isinstance(t, str) and t in names and t != source]


def _encoder_decoder_ties(module: nn.Module) -> list[tuple[str, str]]:
    """4.x's ``tie_encoder_decoder``: in the base model, each encoder module's weight (and bias)
    takes the one at the same path in the decoder (under the decoder's own base model, as
    ``EncoderDecoderModel`` does); decoder layers the encoder lacks (a cross-attention layer
    between two of its own) shift the encoder's layer index back."""
    base = getattr(module, str(getattr(module, "base_model_prefix", "")), None)
    base = base if isinstance(base, nn.Module) else module
    encoder, decoder = getattr(base, "encoder", None), getattr(base, "decoder", None)
    if not isinstance(encoder, nn.Module) or not isinstance(decoder, nn.Module):
        return []
    base_path = next((p for p, m in module.named_modules() if m is base), "")
    prefix = f"{base_path}." if base_path else ""
    decoder_path = f"{prefix}decoder"
    inner = decoder._modules.get(str(getattr(decoder, "base_model_prefix", "")))
    if inner is not None:
        decoder, decoder_path = inner, f"{decoder_path}.{getattr(decoder, 'base_model_prefix', '')}"
    pairs: list[tuple[str, str]] = []
    _pair_modules(encoder, decoder, f"{prefix}encoder", decoder_path, pairs)
    return pairs


def _pair_modules(
    encoder: nn.Module, decoder: nn.Module, encoder_path: str, decoder_path: str, pairs: list[tuple[str, str]]
) -> None:
    if hasattr(decoder, "weight"):  # a leaf for 4.x: its weight and bias, not its children
        pairs.extend((f"{encoder_path}.{a}", f"{decoder_path}.{a}") for a in ("weight", "bias") if hasattr(decoder, a))
        return
    shift = 0
    for name, child in decoder._modules.items():
        if child is None:
            continue
        encoder_name = str(int(name) + shift) if name.isdigit() else name
        counterpart = encoder._modules.get(encoder_name)
        unequal = len(encoder._modules) != len(decoder._modules)
        if name.isdigit() and unequal and not isinstance(child, type(counterpart)):
            shift -= 1  # a decoder-only layer: the encoder's next layer pairs with the decoder's next one
            continue
        if counterpart is not None:
            _pair_modules(counterpart, child, f"{encoder_path}.{encoder_name}", f"{decoder_path}.{name}", pairs)


def unique_tensors(model: nn.Module, plan: TiePlan) -> tuple[list[str], list[torch.Tensor]]:
    """The names to store (each group's source once, every untied name) and their tensors."""
    state = model.state_dict(keep_vars=True)
    names: list[str] = []
    seen: set[str] = set()
    for name in state:
        key = plan.source_of(name)
        if key not in seen:
            seen.add(key)
            names.append(key)
    for group in plan.groups:
        if group.source in seen:
            try:
                tie_changes(model, group)  # retie's checks of names, shapes and dtypes: the file can be re-tied
            except TieError as exc:
                raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    tensors = []
    for name in names:
        tensor = state[name] if name in state else resolve(model, name)[2]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"cannot save {type(model).__name__}: state {name!r} is a {type(tensor).__name__}, not a tensor"
                f"{_extra_state_hint(model, name)}"
            )
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {type(model).__name__}: {name!r} is on the meta device (no data)")
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"cannot save {type(model).__name__}: {name!r} is a {tensor.layout} {tensor.dtype} tensor, "
                "which safetensors cannot store (tiekit's sharded checkpoints keep to its dtypes too, so that "
                "each converts to a safetensors file)"
            )
        tensors.append(tensor.detach())
    return names, tensors


def _extra_state_hint(model: nn.Module, name: str) -> str:
    """Why a state-dict value is no tensor when it is a module's ``get_extra_state``."""
    path, _, last = name.rpartition(".")
    if last != "_extra_state":
        return ""
    try:
        owner = type(model.get_submodule(path)).__name__
    except AttributeError:
        return ""
    return (
        f": {owner}.get_extra_state returned it, and tiekit's checkpoints store a module's extra state only "
        "as a tensor (safetensors holds tensors); return one, such as a uint8 tensor of its serialised bytes"
    )


def host_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-overlapping copies where needed; XLA tensors in one batched transfer."""
    hosts = devices.to_host(list(tensors.values()))
    out = []
    storages: dict[int, list[tuple[int, int]]] = {}
    for t in hosts:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel():
            # Names left out of the plan can still share memory (a reinterpreting view, two
            # slices of one buffer); safetensors refuses overlapping tensors, so store a copy.
            # Disjoint tensors of one storage (fit's state living in its file image) stay.
            start, end = t.data_ptr(), t.data_ptr() + nbytes(t)
            spans = storages.setdefault(t.untyped_storage().data_ptr(), [])
            if any(start < e and s < end for s, e in spans):
                t = t.clone()
            else:
                spans.append((start, end))
        out.append(t)
    return dict(zip(tensors, out, strict=True))


def header_metadata(metadata: Mapping[str, str] | None, plan: TiePlan, call: str = "") -> dict[str, str]:
    if metadata is not None and not isinstance(metadata, Mapping):
        where = f"{call}: " if call else ""
        raise CheckpointError(f"{where}metadata must map strings to strings (a dict), not a {type(metadata).__name__}")
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata must map strings to strings; {key!r}: {value!r} does not")
        if key.startswith("tiekit.") or (key == "format" and value != "pt"):
            raise CheckpointError(f"metadata key {key!r} is reserved by tiekit")
    return {**user, "format": "pt", PLAN_KEY: plan.to_json()}


def encode_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    values: Mapping[str, tuple[Any, str]],
    fallback: Fallback | None = None,
) -> tuple[TiePlan, dict[str, torch.Tensor], dict[str, Any]]:
    """What a training checkpoint holds, as the single-file and the sharded saves write it: the
    tie plan; the tensors (one per tie group, then the tensors of ``values`` and the optimizer
    state); and the JSON record: each of ``values`` (``key: (value, prefix of its tensors)``)
    encoded under its key, then ``"optimizer"``. Local; `CheckpointError` on what cannot be stored."""
    plan = saving_plan(model)
    names, tensors = unique_tensors(model, plan)
    side: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {
        key: encode(value, prefix, side, fallback=fallback) for key, (value, prefix) in values.items()
    }
    record["optimizer"] = None if optimizer is None else optimizer_record(optimizer, model, plan, side)
    clash = sorted(set(names) & set(side))
    if clash:
        raise CheckpointError(f"cannot save {type(model).__name__}: parameter names {clash} clash with optimizer keys")
    return plan, {**dict(zip(names, tensors, strict=True)), **side}, record
