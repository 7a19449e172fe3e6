"""The ties a model declares rather than holds: ``TPUMixin.tied_weights`` and transformers'
``_tied_weights_keys`` (5's expanded ``{target: source}``, 4's list of targets), read from the
model and each submodule and named from the model. What a move re-ties when a plain ``.to`` broke
them, what a save keeps when they still hold, and what a load re-ties. Local."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.checkpoint.deferred import local_part
from tiekit.errors import CheckpointError, TieError
from tiekit.mixin import TPUMixin, tied_weights_of
from tiekit.plan import TiePlan
from tiekit.slots import resolve


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
    try:
        declared = tied_weights_of(module)
    except TieError as exc:
        raise CheckpointError(str(exc)) from exc
    for target, source in declared.items():
        if not isinstance(target, str) or not isinstance(source, str):
            raise CheckpointError(f"{type(module).__name__}.tied_weights maps names to names; got {target!r}")
        try:
            resolve(module, target, "declared tie target (tied_weights)")
            resolve(module, source, "declared tie source (tied_weights)")
        except TieError as exc:
            raise CheckpointError(f"{type(module).__name__}: {exc}") from exc
    return declared


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
