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
Nothing is ever pickled, and decoding never imports or executes anything. Checking a tree
(`check`) is torch-free; torch is imported only to encode live values or decode dtypes/devices.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kdump.bundle.format import DTYPE_SIZES
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K

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


def encode(value: Any, tensors: list[Any], depth: int = 0) -> Any:
    """Encode `value`; tensors found are appended to `tensors` (same object -> same index)."""
    import torch

    from kdump.bundle.tensors import dtype_name

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


def tensors_in(*values: Any) -> list[Any]:
    """The tensors in live values, in tensor-table order (the walk `encode` makes)."""
    found: list[Any] = []
    for v in values:
        encode(v, found)
    return found


def map_tensors(value: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    """A copy of a live value's tuples, lists and dict values with every tensor replaced by
    fn(tensor); everything else is kept as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn, depth + 1) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn, depth + 1) for k, v in value.items()}
    return value


def decode(node: Any, tensor: Callable[[int], Any]) -> Any:
    """Decode a tree; `tensor(i)` supplies tensor i (lazily materialised by the caller)."""
    return _walk(node, lambda i, _path: tensor(i), True, 0, "")


def check(node: Any, n_tensors: int) -> None:
    """Reject a malformed tree, or one referring to a tensor outside a table of `n_tensors`,
    without building anything (torch-free)."""

    def ref(i: int, _path: str) -> None:
        if not 0 <= i < n_tensors:
            raise BundleError("argument tree refers to a tensor that does not exist", K.SCHEMA)

    _walk(node, ref, False, 0, "")


def tensor_paths(
    names: Sequence[str] | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[str]:
    """Readable path of every tensor reference in a checked call, e.g. 'a[1]' or 'd'."""
    paths: dict[int, str] = {}
    roots = [
        (names[i] if names is not None and i < len(names) else f"args[{i}]", a)
        for i, a in enumerate(args)
    ]
    for root, node in [*roots, *kwargs.items()]:
        _walk(node, paths.setdefault, False, 0, root)
    return [paths.get(i, f"tensor{i}") for i in range(max(paths, default=-1) + 1)]


def _walk(node: Any, ref: Callable[[int, str], Any], build: bool, depth: int, path: str) -> Any:
    """The one walk over encoded trees: builds values, or (build=False) only checks them.
    `ref(index, path)` is called for every tensor reference, with its argument path."""
    if depth > MAX_DEPTH:
        raise BundleError("argument tree is nested too deeply", K.SCHEMA)
    if node is None or isinstance(node, (bool, str, int, float)):  # floats: hand-written bundles
        return node
    if isinstance(node, list):
        return [_walk(v, ref, build, depth + 1, f"{path}[{j}]") for j, v in enumerate(node)]
    if not isinstance(node, dict) or len(node) == 0:
        raise BundleError(f"argument tree holds an invalid node: {str(node)[:80]}", K.SCHEMA)
    if "$tensor" in node:
        idx = node["$tensor"]
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise BundleError("argument tree: tensor reference is not an integer", K.SCHEMA)
        return ref(idx, path)
    if "$float" in node:
        try:
            return float(node["$float"])
        except (TypeError, ValueError):
            raise BundleError(f"argument tree: bad float {node['$float']!r}", K.SCHEMA)
    if "$tuple" in node:
        items = node["$tuple"]
        if not isinstance(items, list):
            raise BundleError("argument tree: $tuple is not a list", K.SCHEMA)
        return tuple(_walk(v, ref, build, depth + 1, f"{path}[{j}]") for j, v in enumerate(items))
    if "$dict" in node:
        pairs = node["$dict"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise BundleError("argument tree: $dict is not a list of pairs", K.SCHEMA)
        out = {}
        for k, v in pairs:
            key = _walk(k, ref, build, depth + 1, path)
            try:
                out[key] = _walk(v, ref, build, depth + 1, f"{path}[{k!r}]")
            except TypeError:
                raise BundleError("argument tree: unhashable dict key", K.SCHEMA)
        return out
    if "$dtype" in node:
        name = node["$dtype"]
        if not isinstance(name, str) or name not in DTYPE_SIZES:
            raise BundleError(
                f"unknown dtype {name!r} in bundle (this kdump knows {sorted(DTYPE_SIZES)})",
                K.SCHEMA,
            )
        if not build:
            return None
        from kdump.bundle.tensors import dtype_from_name

        return dtype_from_name(name)
    if "$device" in node:
        if not build:
            return None
        import torch

        try:
            return torch.device(str(node["$device"]))
        except (RuntimeError, ValueError):
            raise BundleError(f"argument tree: bad device {node['$device']!r}", K.SCHEMA)
    if "$enum" in node:
        value = _walk(node.get("value"), ref, build, depth + 1, path)
        return RecordedEnum(str(node["$enum"]), str(node.get("name")), value)
    if "$opaque" in node:
        return Opaque(str(node["$opaque"]), str(node.get("repr", "")))
    raise BundleError(f"argument tree: unknown node type {sorted(node)[:3]}", K.SCHEMA)
