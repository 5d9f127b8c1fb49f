"""Binding a recorded DeepGEMM call's arguments by the parameter names of the build that ran it.

The lines differ in their positional order and spelling: upstream 2.8 appends `epilogue`,
sgl-deep-gemm appends `use_padded_sf_layout` to the k-grouped functions instead, the k-grouped
list is `ks` in most lines and `ks_cpu` in upstream's pybind module (`ks_tensor` in the first
k-grouped builds, `m_indices` for `grouped_layout` in older forks, `epilogue_class` in the .pyi
stub), and the torch.ops and TVM-FFI bindings take an FP8 operand as two arguments (`a`, `sfa`
or `a_sf`) where the Python API takes a (data, scale) pair. A `Binder` maps the runtime's
positional names onto the spec's parameters:

* a runtime name that is a parameter or one of its aliases binds that parameter;
* a scale given on its own (`sfa`, `a_sf`, `sf_a`, ...) joins its operand as (data, scale);
* a name the spec does not know is kept under its own name, as given, when the runtime
  signature names it (a newer build's argument): passed back unchanged, never interpreted; a
  keyword neither the spec nor the runtime signature knows is refused (UsageError);
* missing parameters take the spec's defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from kdump.errors import UsageError
from kdump.kernels.plugin import Param

_EMPTY = inspect.Parameter.empty

# A scale factor passed next to its operand, by the names the split bindings use.
SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "a": ("sfa", "a_sf", "sf_a", "a_scale", "scale_a"),
    "b": ("sfb", "b_sf", "sf_b", "b_scale", "scale_b"),
}
_SCALE_OF = {alias: operand for operand, names in SCALE_NAMES.items() for alias in names}
_SCALE_SLOT = "\0scale:"  # internal key of a split scale until it joins its operand


class Binder:
    """Binds (args, kwargs) by `positional` names onto `params` (see the module docstring)."""

    def __init__(
        self, spec_id: str, params: Sequence[Param], positional: Sequence[str] | None = None
    ) -> None:
        self.spec_id = spec_id
        self.params = tuple(params)
        self.by_alias = {al: p.name for p in self.params for al in (p.name, *p.aliases)}
        self.positional = tuple(positional) if positional else tuple(p.name for p in self.params)
        self.slots = tuple(self._slot(n) for n in self.positional)

    def _slot(self, name: str) -> str:
        """Where a runtime name lands: a parameter, a split scale slot, or itself."""
        if name in self.by_alias:
            return self.by_alias[name]
        operand = _SCALE_OF.get(name)
        if operand is not None and operand in self.by_alias:
            return _SCALE_SLOT + self.by_alias[operand]
        return name

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        bound: dict[str, Any] = {}
        for i, value in enumerate(args):
            slot = self.slots[i] if i < len(self.slots) else f"args[{i}]"
            bound[slot] = value
        for key, value in kwargs.items():
            slot = self._slot(key)
            if slot == key and key not in self.by_alias and key not in self.positional:
                raise UsageError(f"{self.spec_id}: unexpected argument {key!r}")
            if slot in bound:
                raise UsageError(f"{self.spec_id}: argument {slot!r} given twice")
            bound[slot] = value
        _join_scales(bound)
        for p in self.params:
            if p.name not in bound:
                if p.default is _EMPTY:
                    raise UsageError(f"{self.spec_id}: missing argument {p.name!r}")
                bound[p.name] = p.default
        return bound


def _join_scales(bound: dict[str, Any]) -> None:
    for key in [k for k in bound if k.startswith(_SCALE_SLOT)]:
        operand = key[len(_SCALE_SLOT) :]
        scale = bound.pop(key)
        if operand in bound:
            bound[operand] = (bound[operand], scale)
        else:  # a scale without its data: kept by name, the contract names what is missing
            bound[f"{operand}_sf"] = scale


@lru_cache(maxsize=256)
def binder(spec_id: str, params: tuple[Param, ...], positional: tuple[str, ...] | None) -> Binder:
    """A cached Binder: specs bind on every recorded call of the flight recorder."""
    return Binder(spec_id, params, positional)
