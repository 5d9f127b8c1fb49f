"""Routing metadata of recorded calls, as the call's spec summarises it per group: what the
kernel saw of the token distribution (the report's tables and plot, `kdump diff`).

What a routing argument means is the spec's knowledge (`KernelSpec.routing`, e.g. DeepGEMM's
labels, psum ends and masked_m in kernels/deepgemm/routing.py); this module hands the spec a
recorded call's arguments without materialising the call (`Recorded`) and compares summaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdump.bundle import Bundle, Call
from kdump.format.records import TensorRecord
from kdump.kernels.generic import GenericSpec
from kdump.kernels.plugin import KernelSpec, RoutingSummary, RowsUsed
from kdump.kernels.registry import spec_for


def call_spec(bundle: Bundle, call: Call) -> KernelSpec:
    """The call's spec, configured with the library settings the bundle recorded."""
    spec = spec_for(call.target, call.names)
    lib = spec.library()
    libraries = bundle.env.get("libraries")
    settings = libraries.get(lib) if lib and isinstance(libraries, dict) else None
    return spec.with_settings(settings if isinstance(settings, Mapping) else None)


def bind_encoded(spec: KernelSpec, call: Call) -> dict[str, Any]:
    """Arguments by parameter name as encoded trees ({'$tensor': i} for tensors); positional
    names (or args[i]) when the call does not fit the spec's signature."""
    try:
        return spec.bind(call.encoded_args, call.encoded_kwargs)
    except Exception:  # a call that breaks the signature is still worth describing
        return GenericSpec(call.target, call.names).bind(call.encoded_args, call.encoded_kwargs)


def tensor_refs(node: Any) -> list[int]:
    """Indices of the tensors inside an encoded argument tree ({'$tensor': i}), in tree order."""
    if isinstance(node, dict):
        if isinstance(node.get("$tensor"), int):
            return [node["$tensor"]]
        return [i for v in node.values() for i in tensor_refs(v)]
    if isinstance(node, list):
        return [i for v in node for i in tensor_refs(v)]
    return []


def tensor_ref(node: Any) -> int | None:
    """Index of the first tensor inside an encoded argument tree, if any."""
    refs = tensor_refs(node)
    return refs[0] if refs else None


def read_tensor(bundle: Bundle, call: Call, index: int) -> torch.Tensor:
    """One of the call's input tensors on the CPU, without materialising the others."""
    rec: TensorRecord = call.tensors[index]
    mat = bundle.materialize_records([call.storages[rec.storage]], [replace(rec, storage=0)])
    return mat.tensors[0]


class Recorded:
    """A recorded call's arguments by the spec's parameter names, read from the bundle one
    tensor at a time (kernels.plugin.RecordedArgs)."""

    def __init__(self, bundle: Bundle, call: Call, spec: KernelSpec) -> None:
        self.bundle, self.call = bundle, call
        self.bound = bind_encoded(spec, call)

    def value(self, name: str) -> Any:
        return self.bound.get(name)

    def _ref(self, name: str) -> int | None:
        ref = tensor_ref(self.bound.get(name))
        return ref if ref is not None and ref < len(self.call.tensors) else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        ref = self._ref(name)
        return None if ref is None else tuple(self.call.tensors[ref].shape)

    def dtype(self, name: str) -> str | None:
        ref = self._ref(name)
        return None if ref is None else self.call.tensors[ref].dtype

    def read(self, name: str) -> torch.Tensor | None:
        ref = self._ref(name)
        return None if ref is None else read_tensor(self.bundle, self.call, ref)


def routing_summaries(bundle: Bundle, call: Call) -> list[RoutingSummary]:
    """A summary of every routing argument of `call` that is a 1-D integer tensor."""
    spec = call_spec(bundle, call)
    return spec.routing(Recorded(bundle, call, spec))


def rows_used(bundle: Bundle, call: Call, spec: KernelSpec) -> RowsUsed | None:
    """The activation rows and weight groups `call` reads, as its spec tells from the routing."""
    return spec.rows_used(Recorded(bundle, call, spec))


@dataclass(frozen=True)
class RoutingDiff:
    """The same routing argument in two calls, group by group."""

    a: RoutingSummary
    b: RoutingSummary

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.a.groups) | set(self.b.groups)))

    @property
    def changed(self) -> tuple[int, ...]:
        return tuple(g for g in self.groups if (self.a.count(g) or 0) != (self.b.count(g) or 0))

    @property
    def differs(self) -> bool:
        return bool(self.changed) or (self.a.layout, self.a.padding, self.a.invalid) != (
            self.b.layout,
            self.b.padding,
            self.b.invalid,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "argument": self.a.argument,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "changed_groups": list(self.changed),
        }


def diff_routing(a: list[RoutingSummary], b: list[RoutingSummary]) -> list[RoutingDiff]:
    """Pairs of summaries of the same argument (arguments in only one call are left out: the
    argument difference already says so)."""
    by_name = {s.argument: s for s in b}
    return [RoutingDiff(s, by_name[s.argument]) for s in a if s.argument in by_name]
