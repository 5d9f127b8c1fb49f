"""The argument tree: a call's arguments as JSON, with tensors replaced by references.

Encoding (docs/FORMAT.md, "Argument tree"):
  null, true/false, int, str          as themselves
  float                               {"$float": "1.5"} (repr, so nan/inf/-0.0 survive)
  list                                [...]
  tuple                               {"$tuple": [...]}
  dict                                {"$dict": [[key, value], ...]}
  tensor                              {"$tensor": i}       index into the call's tensor table
  torch.dtype / torch.device          {"$dtype": "bfloat16"} / {"$device": "cuda:0"}
  enum member                         {"$enum": "module.Class", "name": "X", "value": <tree>}
  anything else                       {"$opaque": "module.Class", "repr": "..."}
Nothing is ever pickled, and decoding never imports or executes anything.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kdump.bundle.tensors import dtype_from_name, dtype_name
from kdump.errors import BundleError

MAX_DEPTH = 64
MAX_REPR = 2000


@dataclass(frozen=True)
class RecordedEnum:
    """An enum member as recorded: its class name, member name and value (never imported)."""

    cls: str
    name: str
    value: Any

    def __int__(self) -> int:
        return int(self.value)


@dataclass(frozen=True)
class Opaque:
    """An argument kdump could not serialise: its type and repr, for the report."""

    cls: str
    repr: str


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def encode(value: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    """Encode `value`; tensors found are appended to `tensors` (same object -> same index)."""
    if depth > MAX_DEPTH:
        return {"$opaque": _qualname(value), "repr": "<nested too deep>"}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {
            "$enum": _qualname(value),
            "name": value.name,
            "value": encode(value.value, tensors, depth + 1),
        }
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return {"$float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        for i, t in enumerate(tensors):
            if t is value:
                return {"$tensor": i}
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, tensors, depth + 1) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors, depth + 1) for v in value]
    if isinstance(value, dict):
        return {
            "$dict": [
                [encode(k, tensors, depth + 1), encode(v, tensors, depth + 1)]
                for k, v in value.items()
            ]
        }
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not stop recording
        text = f"<repr failed: {type(exc).__name__}>"
    return {"$opaque": _qualname(value), "repr": text[:MAX_REPR]}


def decode(node: Any, tensor: Callable[[int], Any], depth: int = 0) -> Any:
    """Decode a tree; `tensor(i)` supplies tensor i (lazily materialised by the caller)."""
    if depth > MAX_DEPTH:
        raise BundleError("argument tree is nested too deeply")
    if node is None or isinstance(node, (bool, str)):
        return node
    if isinstance(node, int):
        return node
    if isinstance(node, float):  # tolerated from hand-written bundles
        return node
    if isinstance(node, list):
        return [decode(v, tensor, depth + 1) for v in node]
    if not isinstance(node, dict) or len(node) == 0:
        raise BundleError(f"argument tree holds an invalid node: {str(node)[:80]}")
    if "$tensor" in node:
        idx = node["$tensor"]
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise BundleError("argument tree: tensor reference is not an integer")
        return tensor(idx)
    if "$float" in node:
        try:
            return float(node["$float"])
        except (TypeError, ValueError):
            raise BundleError(f"argument tree: bad float {node['$float']!r}")
    if "$tuple" in node:
        items = node["$tuple"]
        if not isinstance(items, list):
            raise BundleError("argument tree: $tuple is not a list")
        return tuple(decode(v, tensor, depth + 1) for v in items)
    if "$dict" in node:
        pairs = node["$dict"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise BundleError("argument tree: $dict is not a list of pairs")
        out = {}
        for k, v in pairs:
            key = decode(k, tensor, depth + 1)
            try:
                out[key] = decode(v, tensor, depth + 1)
            except TypeError:
                raise BundleError("argument tree: unhashable dict key")
        return out
    if "$dtype" in node:
        return dtype_from_name(node["$dtype"])
    if "$device" in node:
        try:
            return torch.device(str(node["$device"]))
        except (RuntimeError, ValueError):
            raise BundleError(f"argument tree: bad device {node['$device']!r}")
    if "$enum" in node:
        return RecordedEnum(
            str(node["$enum"]), str(node.get("name")), decode(node.get("value"), tensor, depth + 1)
        )
    if "$opaque" in node:
        return Opaque(str(node["$opaque"]), str(node.get("repr", "")))
    raise BundleError(f"argument tree: unknown node type {sorted(node)[:3]}")


def tensor_refs(node: Any, depth: int = 0) -> list[int]:
    """Every tensor index a tree refers to, in order."""
    if depth > MAX_DEPTH:
        raise BundleError("argument tree is nested too deeply")
    if isinstance(node, list):
        return [i for v in node for i in tensor_refs(v, depth + 1)]
    if isinstance(node, dict):
        if "$tensor" in node:
            return [node["$tensor"]]
        return [i for v in node.values() for i in tensor_refs(v, depth + 1)]
    return []


def is_finite_float(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)
