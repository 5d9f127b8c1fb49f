"""Routing metadata summarised per group: what the kernel saw of the token distribution.

Layouts (DeepGEMM's m-grouped GEMMs):
- labels: `grouped_layout` int32 [M], the group of each row, -1 for padding rows;
- psum: `grouped_layout` int32 [G] of cumulative end rows (`use_psum_layout=True`); group g
  occupies rows [align(end[g-1], A), end[g]) with A the mk alignment, group 0 starts at row 0;
- masked: `masked_m` int32 [G], the valid rows of each group's [max_m] block.
Any other 1-D int32 routing tensor becomes a histogram of its values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdump.bundle import Bundle, Call
from kdump.bundle.tensors import TensorRecord
from kdump.kernels.plugin import KernelSpec, Role
from kdump.kernels.registry import spec_for

DEFAULT_MK_ALIGNMENT = 128


@dataclass(frozen=True)
class RoutingSummary:
    argument: str
    layout: str  # labels | psum | masked | histogram
    groups: tuple[int, ...]  # group ids (histogram: the distinct values)
    counts: tuple[int, ...]  # rows (tokens) of each group
    padding: int | None = None  # rows that belong to no group (None: not defined for the layout)
    invalid: int = 0  # labels outside [-1, G), negative or decreasing psum ends
    rows: int | None = None  # rows of the M dimension the layout covers

    @property
    def empty_groups(self) -> tuple[int, ...]:
        return tuple(g for g, c in zip(self.groups, self.counts) if c == 0)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def count(self, group: int) -> int | None:
        return dict(zip(self.groups, self.counts)).get(group)

    def to_json(self) -> dict[str, Any]:
        return {
            "argument": self.argument,
            "layout": self.layout,
            "groups": list(self.groups),
            "counts": list(self.counts),
            "tokens": self.tokens,
            "empty_groups": list(self.empty_groups),
            "padding": self.padding,
            "invalid": self.invalid,
            "rows": self.rows,
        }


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
        names = call.names or []
        bound = {
            (names[i] if i < len(names) else f"args[{i}]"): a
            for i, a in enumerate(call.encoded_args)
        }
        bound.update(call.encoded_kwargs)
        return bound


def tensor_ref(node: Any) -> int | None:
    """Index of the first tensor inside an encoded argument tree, if any."""
    if isinstance(node, dict):
        if isinstance(node.get("$tensor"), int):
            return node["$tensor"]
        children = list(node.values())
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = tensor_ref(child)
        if found is not None:
            return found
    return None


def read_tensor(bundle: Bundle, call: Call, index: int) -> torch.Tensor:
    """One of the call's input tensors on the CPU, without materialising the others."""
    rec: TensorRecord = call.tensors[index]
    mat = bundle.materialize_records([call.storages[rec.storage]], [replace(rec, storage=0)])
    return mat.tensors[0]


def _first_dim(call: Call, node: Any, dim: int) -> int | None:
    ref = tensor_ref(node)
    if ref is None or ref >= len(call.tensors):
        return None
    shape = call.tensors[ref].shape
    return shape[dim] if len(shape) > dim else None


def routing_summaries(bundle: Bundle, call: Call) -> list[RoutingSummary]:
    """A summary of every routing argument of `call` that is a 1-D integer tensor."""
    spec = call_spec(bundle, call)
    bound = bind_encoded(spec, call)
    out = []
    for name in spec.names_with_role(Role.ROUTING):
        ref = tensor_ref(bound.get(name))
        if ref is None or not isinstance(bound.get(name), dict) or ref >= len(call.tensors):
            continue
        rec = call.tensors[ref]
        if len(rec.shape) != 1 or rec.dtype not in ("int32", "int64"):
            continue
        values = [int(v) for v in read_tensor(bundle, call, ref).tolist()]
        groups = _first_dim(call, bound.get("b"), 0)
        if name == "masked_m":
            out.append(summarize_masked(name, values, _first_dim(call, bound.get("a"), 1)))
        elif name == "grouped_layout" and bound.get("use_psum_layout") is True:
            alignment = getattr(spec, "mk_alignment", DEFAULT_MK_ALIGNMENT)
            out.append(summarize_psum(name, values, alignment))
        elif name == "grouped_layout" and groups is not None:
            out.append(summarize_labels(name, values, groups))
        else:
            out.append(summarize_histogram(name, values))
    return out


def summarize_labels(name: str, labels: list[int], groups: int) -> RoutingSummary:
    tally = Counter(labels)
    counts = tuple(tally.get(g, 0) for g in range(groups))
    padding = tally.get(-1, 0)
    return RoutingSummary(
        name,
        "labels",
        tuple(range(groups)),
        counts,
        padding=padding,
        invalid=len(labels) - padding - sum(counts),
        rows=len(labels),
    )


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def summarize_psum(name: str, ends: list[int], alignment: int) -> RoutingSummary:
    counts, padding, invalid, prev_end = [], 0, 0, 0
    for g, end in enumerate(ends):
        start = 0 if g == 0 else _align(prev_end, alignment)
        if end < start:
            invalid += 1
        counts.append(max(0, end - start))
        padding += start - prev_end if g else 0
        prev_end = max(end, start)
    return RoutingSummary(
        name,
        "psum",
        tuple(range(len(ends))),
        tuple(counts),
        padding=padding,
        invalid=invalid,
        rows=ends[-1] if ends else 0,
    )


def summarize_masked(name: str, masked_m: list[int], max_m: int | None) -> RoutingSummary:
    invalid = sum(1 for m in masked_m if m < 0 or (max_m is not None and m > max_m))
    return RoutingSummary(
        name,
        "masked",
        tuple(range(len(masked_m))),
        tuple(max(0, m) for m in masked_m),
        padding=None if max_m is None else sum(max_m - min(max(m, 0), max_m) for m in masked_m),
        invalid=invalid,
        rows=None if max_m is None else max_m * len(masked_m),
    )


def summarize_histogram(name: str, values: list[int]) -> RoutingSummary:
    tally = sorted(Counter(values).items())
    return RoutingSummary(
        name,
        "histogram",
        tuple(v for v, _ in tally),
        tuple(c for _, c in tally),
        rows=len(values),
    )


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
