"""Which checkpoint tensors fill a module's parameters: transformers' own key mapping.

A checkpoint's keys need not be the module's names (Note [Checkpoint keys]). checkpoint_keys()
applies to the checkpoint's key list the transforms from_pretrained applies, and says for each
name of the module's state dict which checkpoint key holds it, or which Conversion builds it
from several. Nothing here reads a tensor; Conversion.build does, when the caller asks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

# Note [Checkpoint keys]
# ~~~~~~~~~~~~~~~~~~~~~~~
# transformers renames keys as it loads and builds some parameters from several tensors:
# GPT-NeoX's checkpoints keep `embed_out.weight` for the module's `lm_head.weight` (a rename),
# Mixtral's keep one `experts.{i}.w1.weight` per expert for the module's fused
# `experts.gate_up_proj` (a conversion: stacked, then concatenated with w3). The list of transforms
# is transformers' own (conversion_mapping.get_model_conversion_mapping: the model's class or
# model_type, its sub-models', its fused modules', the legacy renames), applied as
# core_model_loading.convert_and_load_state_dict_in_model applies it: the checkpoint's keys in
# natural order, every rename then at most one converter (rename_source_key), the base model
# prefix added or stripped as the module's names need, the first key that reaches a name wins.
# A module transformers does not know, or one it has no mapping for, keeps its names: a key
# equal to the name, without the base prefix or with it. A transformers upgrade that renames a
# module therefore brings the rename with it; no table here repeats transformers'.


@dataclass
class Conversion:
    """A transformers WeightConverter bound to the checkpoint keys it reads.

    ``sources`` maps each of the converter's source patterns to its keys, in the order the
    converter takes them (natural order: ``experts.2`` before ``experts.10``); ``targets`` are
    the module's names it builds (``first`` among them is transformers' layer name for it)."""

    first: str
    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        """Every checkpoint key it reads."""
        return [k for keys in self.sources.values() for k in keys]

    def describe(self) -> str:
        ops = ", ".join(type(op).__name__ for op in getattr(self.converter, "operations", []))
        return f"{ops or type(self.converter).__name__} of {len(self.keys)} checkpoint tensors"

    def build(
        self, read: Callable[[str], torch.Tensor], model: nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """Runs the converter once on the tensors `read(key)` gives: each target's tensor."""
        converter = deepcopy(self.converter)  # convert() consumes what it collected
        for pattern, keys in self.sources.items():
            converter.collected_tensors[pattern] = [partial(read, k) for k in keys]
        config = getattr(model, "config", None)
        out = converter.convert(self.first, model=model, config=config)
        return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}


class KeyMap:
    """For each name of a module's state dict, its checkpoint key or the Conversion that builds
    it (Note [Checkpoint keys])."""

    def __init__(
        self, prefix: str, plan: dict[str, str | Conversion], transforms: list[Any], owner: str
    ) -> None:
        self.prefix = prefix
        self._plan = plan
        self._transforms = transforms
        self._owner = owner  # the class whose transformers mapping this is, "" without one

    def _candidates(self, name: str) -> list[str]:
        p = self.prefix
        out = [name]
        for c in (name.removeprefix(p + ".") if p else name, f"{p}.{name}" if p else name):
            if c not in out:
                out.append(c)
        return out

    def key_of(self, name: str, present: Collection[str]) -> str | None:
        """The checkpoint key of `name` among `present`; a converted name is its own key once
        the caller keeps what the Conversion built under it. None when nothing holds it."""
        planned = self._plan.get(name)
        if isinstance(planned, Conversion):
            return name if name in present else None
        if planned is not None and planned in present:
            return planned
        return next((c for c in self._candidates(name) if c in present), None)

    def conversion_of(self, name: str) -> Conversion | None:
        planned = self._plan.get(name)
        return planned if isinstance(planned, Conversion) else None

    def conversions(self) -> list[Conversion]:
        """Every Conversion, once each (one may build several names)."""
        seen: dict[int, Conversion] = {}
        for planned in self._plan.values():
            if isinstance(planned, Conversion):
                seen.setdefault(id(planned), planned)
        return list(seen.values())

    def tried(self, name: str) -> str:
        """What was looked for, for an error: the names and the transforms that could give it."""
        names = ", ".join(repr(c) for c in self._candidates(name))
        if not self._owner:
            return f"tried {names}"
        near = [
            f"{'|'.join(t.source_patterns)} -> {'|'.join(t.target_patterns)}"
            for t in self._transforms
            if any(
                all(part in name for part in tp.split("\\1") if part) for tp in t.target_patterns
            )
        ]
        mapping = f"transformers' conversion mapping for {self._owner}"
        if near:
            return f"tried {names} and {mapping} ({'; '.join(near[:4])})"
        return (
            f"tried {names}; none of the {len(self._transforms)} transforms of {mapping} gives it"
        )


def _transforms(module: nn.Module) -> tuple[list[Any], str]:
    """transformers' weight transforms for `module` and its class name; none for a module
    that is not a transformers model (transformers is then not imported)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return [], ""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(module)), type(module).__name__


def _targets(first: str, converter: Any, names: Collection[str]) -> list[str]:
    """The names a converter whose first target is `first` builds, as WeightConverter.convert
    expands its target patterns (the prefix and suffix around the first one in `first`)."""
    patterns = list(converter.target_patterns)
    head = next((p for p in patterns if p in first), None)
    if head is None:
        return [first]
    before, _, after = first.partition(head)
    out = [before + p + after for p in patterns]
    return [t for t in out if t in names] or [first]


def checkpoint_keys(module: nn.Module, keys: Iterable[str]) -> KeyMap:
    """The KeyMap of `module` for a checkpoint holding `keys` (Note [Checkpoint keys])."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    transforms, owner = _transforms(module)
    plan: dict[str, str | Conversion] = {}
    if not transforms:
        return KeyMap(prefix, plan, [], "")
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    names = dict.fromkeys(module.state_dict(keep_vars=True), True)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    base = prefix or None
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, base, names)
        if target not in names and key in names:  # as from_pretrained: the key was right
            target, pattern = rename_source_key(key, [], [], base, names)
        if target not in names:
            continue  # a tensor the module does not use
        if pattern is None:
            plan.setdefault(target, key)
            continue
        planned = plan.setdefault(target, Conversion(target, by_pattern[pattern]))
        if isinstance(planned, Conversion):
            planned.sources.setdefault(pattern, []).append(key)
    for conversion in [p for p in plan.values() if isinstance(p, Conversion)]:
        conversion.targets = _targets(conversion.first, conversion.converter, names)
        for t in conversion.targets:
            plan.setdefault(t, conversion)
    return KeyMap(prefix, plan, transforms, owner)
