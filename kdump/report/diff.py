"""What differs between two recorded calls: target, tensor layouts, other arguments,
environment, library settings, and routing metadata group by group."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kdump.bundle import Bundle, Call
from kdump.bundle.inspect import aliasing_groups
from kdump.report.routing import (
    RoutingDiff,
    bind_encoded,
    call_spec,
    diff_routing,
    routing_summaries,
    tensor_ref,
)

# Alignment is compared up to 16 bytes, the most any supported kernel requires (TMA base
# addresses, 128-bit vector loads); beyond that an address's alignment is allocator chance.
ALIGNMENT_CAP = 16
# Environment keys that differ between any two processes and say nothing about the bug.
_ENV_NOISE = frozenset({"pid"})

SECTIONS = ("target", "tensor", "aliasing", "argument", "routing", "library", "env", "meta")
LAYOUT_SECTIONS = frozenset({"tensor", "aliasing"})


@dataclass(frozen=True)
class Difference:
    section: str  # one of SECTIONS
    item: str  # e.g. "a[0] stride", "env_vars.CUDA_LAUNCH_BLOCKING"
    a: str  # value in A ("-" when absent)
    b: str


@dataclass(frozen=True)
class CallDiff:
    a_label: str
    b_label: str
    differences: tuple[Difference, ...]
    routing: tuple[RoutingDiff, ...]

    @property
    def identical(self) -> bool:
        return not self.differences

    def in_section(self, *sections: str) -> list[Difference]:
        return [d for d in self.differences if d.section in sections]

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a_label,
            "b": self.b_label,
            "identical": self.identical,
            "differences": [asdict(d) for d in self.differences],
            "routing": [r.to_json() for r in self.routing],
        }


ABSENT = "-"


def show(value: Any) -> str:
    """A recorded value as compact text (JSON for trees, so types stay visible)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def alignment_class(data_ptr: int) -> str:
    """The power-of-two alignment of an address, up to ALIGNMENT_CAP ("?" when unknown)."""
    if not data_ptr:
        return "?"
    align = 1
    while align < ALIGNMENT_CAP and data_ptr % (align * 2) == 0:
        align *= 2
    return f"{align}" if align < ALIGNMENT_CAP else f">={ALIGNMENT_CAP}"


def tensor_layouts(call: Call) -> dict[str, dict[str, str]]:
    """Per argument path: the layout facts compared by diff."""
    out = {}
    for name, rec in zip(call.tensor_names, call.tensors):
        out[name] = {
            "dtype": rec.dtype,
            "shape": show(list(rec.shape)),
            "stride": show(list(rec.stride)),
            "offset": str(rec.storage_offset),
            "alignment": alignment_class(rec.data_ptr),
            "device": call.storages[rec.storage].device,
        }
    return out


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys with printable leaves."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: show(tree)} if prefix else {}


def scalar_arguments(bundle: Bundle, call: Call) -> dict[str, str]:
    """Arguments that hold no tensor, by parameter name, as recorded."""
    bound = bind_encoded(call_spec(bundle, call), call)
    return {k: show(v) for k, v in bound.items() if tensor_ref(v) is None}


def _compare(section: str, a: Mapping[str, str], b: Mapping[str, str]) -> list[Difference]:
    keys = list(a) + [k for k in b if k not in a]
    return [
        Difference(section, k, a.get(k, ABSENT), b.get(k, ABSENT))
        for k in keys
        if a.get(k, ABSENT) != b.get(k, ABSENT)
    ]


def _environment(bundle: Bundle) -> tuple[dict[str, str], dict[str, str]]:
    env = {k: v for k, v in bundle.env.items() if k not in _ENV_NOISE}
    libraries = env.pop("libraries", None) or {}
    return flatten(env), flatten(libraries)


def diff_calls(
    a_bundle: Bundle, a: Call, b_bundle: Bundle, b: Call, a_label: str = "A", b_label: str = "B"
) -> CallDiff:
    diffs = _compare("target", {"target": a.target}, {"target": b.target})
    la, lb = tensor_layouts(a), tensor_layouts(b)
    for name in list(la) + [n for n in lb if n not in la]:
        if name not in la or name not in lb:
            diffs.append(
                Difference(
                    "tensor",
                    name,
                    "present" if name in la else ABSENT,
                    "present" if name in lb else ABSENT,
                )
            )
            continue
        for field, va in la[name].items():
            if va != lb[name][field]:
                diffs.append(Difference("tensor", f"{name} {field}", va, lb[name][field]))
    ga = sorted(" = ".join(g) for g in aliasing_groups(a))
    gb = sorted(" = ".join(g) for g in aliasing_groups(b))
    if ga != gb:
        diffs.append(
            Difference(
                "aliasing", "shared storage", "; ".join(ga) or "none", "; ".join(gb) or "none"
            )
        )
    diffs += _compare("argument", scalar_arguments(a_bundle, a), scalar_arguments(b_bundle, b))
    routing = diff_routing(routing_summaries(a_bundle, a), routing_summaries(b_bundle, b))
    for r in routing:
        for g in r.changed:
            diffs.append(
                Difference(
                    "routing",
                    f"{r.a.argument} group {g}",
                    show(r.a.count(g) if r.a.count(g) is not None else ABSENT),
                    show(r.b.count(g) if r.b.count(g) is not None else ABSENT),
                )
            )
        for field in ("layout", "padding", "invalid"):
            va, vb = getattr(r.a, field), getattr(r.b, field)
            if va != vb:
                diffs.append(Difference("routing", f"{r.a.argument} {field}", show(va), show(vb)))
    env_a, lib_a = _environment(a_bundle)
    env_b, lib_b = _environment(b_bundle)
    diffs += _compare("library", lib_a, lib_b)
    diffs += _compare("env", env_a, env_b)
    diffs += _compare("meta", flatten(a.meta), flatten(b.meta))
    return CallDiff(a_label, b_label, tuple(diffs), tuple(routing))
