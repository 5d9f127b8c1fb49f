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
  Pointer(address)                    {"$pointer": address}  a raw device address (version 6)
  anything else                       {"$opaque": "module.Class", "repr": "..."}
Nothing is ever pickled, and decoding never imports or executes anything. Checking a tree
(`check`) is torch-free; torch is imported only to encode live values or decode dtypes/devices.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format.records import DTYPE_SIZES, Limits

LIMITS = Limits()
MAX_DEPTH = LIMITS.max_tree_depth
MAX_REPR = 2000


@dataclass(frozen=True)
class RecordedEnum:
    """An enum member as recorded: its class name, member name and value (never imported)."""

    cls: str
    name: str
    value: Any

    def __hash__(self) -> int:
        # by class and member: a member can be a dict key while its value is a list or a dict
        return hash((self.cls, self.name))

    def __int__(self) -> int:
        return int(self.value)


@dataclass(frozen=True)
class Opaque:
    """An argument kdump could not serialise: its type and repr, for the report."""

    cls: str
    repr: str


@dataclass(frozen=True)
class Pointer:
    """A raw address passed as an integer (another rank's symmetric memory, a pointer a Triton
    kernel takes as an int): recorded as the number it was, marked so that a replay knows the
    memory behind it was not recorded. Recorders wrap such integers in it; decoding gives it
    back."""

    address: int

    def __int__(self) -> int:
        return self.address


MAX_ADDRESS = (1 << 64) - 1


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class _Budget:
    """Nodes left for one set of trees (`Limits.max_tree_nodes`). The writer spends only half, so
    the placeholders it leaves once the budget is out (one per open container and per remaining
    top-level value) still fit the reader's bound."""

    def __init__(self, limits: Limits, share: float = 1.0) -> None:
        self.limits = limits
        self.nodes = int(limits.max_tree_nodes * share)

    def take(self) -> bool:
        self.nodes -= 1
        return self.nodes >= 0

    @property
    def spent(self) -> bool:
        return self.nodes <= 0


def _items(values: Any, tensors: list[Any], depth: int, budget: _Budget) -> list[Any]:
    """Encode a container's items; once the budget is spent the rest become one placeholder."""
    out = []
    for v in values:
        if budget.spent:
            out.append(_placeholder(v, "too large (too many nodes)"))
            break
        out.append(encode(v, tensors, depth + 1, budget))
    return out


def _placeholder(value: Any, why: str) -> dict[str, str]:
    from kdump.log import log_once

    log_once(
        f"argtree:{why}",
        f"an argument of type {_qualname(value)} is {why}; it is recorded as a placeholder "
        "(replays of such calls see an opaque value)",
    )
    return {"$opaque": _qualname(value), "repr": f"<{why}>"}


_TORCH: Any = None  # torch, once `encode` imported it (it runs for every recorded argument)


def _torch() -> Any:
    global _TORCH
    import torch

    _TORCH = torch
    return torch


def encode(value: Any, tensors: list[Any], depth: int = 0, budget: _Budget | None = None) -> Any:
    """Encode `value`; tensors found are appended to `tensors` (same object -> same index).

    A value the reader would reject (nested deeper than `Limits.max_tree_depth`, more nodes than
    `Limits.max_tree_nodes` across one `budget`, a string over `Limits.max_string`) becomes an
    `$opaque` placeholder saying why, so the bundle stays readable."""
    torch = _TORCH if _TORCH is not None else _torch()
    if budget is None:
        budget = _Budget(LIMITS, 0.5)
    limits = budget.limits
    # The placeholder is itself a node at this depth, so the reader's bound still holds.
    if depth >= limits.max_tree_depth:
        return _placeholder(value, "nested too deep")
    if not budget.take():
        return _placeholder(value, "too large (too many nodes)")
    if isinstance(value, torch.Tensor):  # first: most arguments of a kernel are tensors
        for i, t in enumerate(tensors):
            if t is value:
                return {"$tensor": i}
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if len(value) > limits.max_string:
            return _placeholder(value, "a string too long")
        return value
    if isinstance(value, enum.Enum):
        return {
            "$enum": _qualname(value),
            "name": value.name,
            "value": encode(value.value, tensors, depth + 1, budget),
        }
    if isinstance(value, int):
        return int(value)
    if isinstance(value, Pointer):
        return {"$pointer": int(value.address) & MAX_ADDRESS}
    if isinstance(value, float):
        return {"$float": repr(float(value))}
    if isinstance(value, torch.dtype):
        from kdump.format.dtypes import dtype_name

        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, tuple):
        return {"$tuple": _items(value, tensors, depth, budget)}
    if isinstance(value, list):
        return _items(value, tensors, depth, budget)
    if isinstance(value, dict):
        pairs = []
        for k, v in value.items():
            if budget.spent:
                break  # (a pair cannot be a placeholder: the rest of the dict is left out)
            pairs.append(
                [encode(k, tensors, depth + 1, budget), encode(v, tensors, depth + 1, budget)]
            )
        return {"$dict": pairs}
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not stop recording
        text = f"<repr failed: {type(exc).__name__}>"
    return {"$opaque": _qualname(value), "repr": text[:MAX_REPR]}


def encode_all(
    values: Sequence[Any], tensors: list[Any], limits: Limits | None = None
) -> list[Any]:
    """Encode several trees that share one node budget (a call's arguments)."""
    budget = _Budget(limits or LIMITS, 0.5)
    return [encode(v, tensors, 0, budget) for v in values]


def tensors_in(*values: Any) -> list[Any]:
    """The tensors in live values, in tensor-table order (the walk `encode` makes)."""
    found: list[Any] = []
    encode_all(values, found)
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


def check(node: Any, n_tensors: int, budget: _Budget | None = None) -> None:
    """Reject a malformed tree, one referring to a tensor outside a table of `n_tensors`, or one
    over the limits (depth, strings, and the nodes left in `budget`, which several trees may
    share), without building anything (torch-free)."""

    def ref(i: int, _path: str) -> None:
        if not 0 <= i < n_tensors:
            raise BundleError("argument tree refers to a tensor that does not exist", K.SCHEMA)

    _walk(node, ref, False, 0, "", budget or _Budget(LIMITS))


def new_budget(limits: Limits) -> _Budget:
    return _Budget(limits)


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


def pointer_paths(
    names: Sequence[str] | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[tuple[str, int]]:
    """(argument path, address) of every `$pointer` node in a checked call's trees."""
    found: list[tuple[str, int]] = []

    def visit(node: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(node, list):
            for j, v in enumerate(node):
                visit(v, f"{path}[{j}]", depth + 1)
        elif isinstance(node, dict):
            if "$pointer" in node:
                found.append((path, int(node["$pointer"])))
            elif "$tuple" in node:
                visit(node["$tuple"], path, depth + 1)
            elif "$enum" in node:
                visit(node.get("value"), path, depth + 1)
            elif isinstance(node.get("$dict"), list):
                for pair in node["$dict"]:
                    if isinstance(pair, list) and len(pair) == 2:
                        visit(pair[1], f"{path}[{str(pair[0])[:64]}]", depth + 1)

    roots = [
        (names[i] if names is not None and i < len(names) else f"args[{i}]", a)
        for i, a in enumerate(args)
    ]
    for root, node in [*roots, *kwargs.items()]:
        visit(node, root, 0)
    return found


def _walk(
    node: Any,
    ref: Callable[[int, str], Any],
    build: bool,
    depth: int,
    path: str,
    budget: _Budget | None = None,
) -> Any:
    """The one walk over encoded trees: builds values, or (build=False) only checks them.
    `ref(index, path)` is called for every tensor reference, with its argument path. With a
    `budget`, every node and string is also held to its limits."""
    _hold_to_limits(node, depth, budget)
    if node is None or isinstance(node, (bool, str, int, float)):  # floats: hand-written bundles
        return node
    if isinstance(node, list):
        return [_walk(v, ref, build, depth + 1, f"{path}[{j}]", budget) for j, v in enumerate(node)]
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
            raise BundleError(f"argument tree: bad float {str(node['$float'])[:40]!r}", K.SCHEMA)
    if "$tuple" in node:
        items = node["$tuple"]
        if not isinstance(items, list):
            raise BundleError("argument tree: $tuple is not a list", K.SCHEMA)
        return tuple(
            _walk(v, ref, build, depth + 1, f"{path}[{j}]", budget) for j, v in enumerate(items)
        )
    if "$dict" in node:
        pairs = node["$dict"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise BundleError("argument tree: $dict is not a list of pairs", K.SCHEMA)
        out = {}
        for k, v in pairs:
            key = _walk(k, ref, build, depth + 1, path, budget)
            try:
                out[key] = _walk(v, ref, build, depth + 1, f"{path}[{repr(k)[:64]}]", budget)
            except TypeError:
                raise BundleError("argument tree: unhashable dict key", K.SCHEMA)
        return out
    if "$dtype" in node:
        name = node["$dtype"]
        if not isinstance(name, str) or name not in DTYPE_SIZES:
            raise BundleError(
                f"unknown dtype {str(name)[:40]!r} in bundle "
                f"(this kdump knows {sorted(DTYPE_SIZES)})",
                K.SCHEMA,
            )
        if not build:
            return None
        from kdump.format.dtypes import dtype_from_name

        return dtype_from_name(name)
    if "$device" in node:
        if not build:
            return None
        import torch

        try:
            return torch.device(str(node["$device"]))
        except (RuntimeError, ValueError):
            raise BundleError(f"argument tree: bad device {str(node['$device'])[:40]!r}", K.SCHEMA)
    if "$enum" in node:
        value = _walk(node.get("value"), ref, build, depth + 1, path, budget)
        return RecordedEnum(str(node["$enum"]), str(node.get("name")), value)
    if "$pointer" in node:
        address = node["$pointer"]
        if not isinstance(address, int) or isinstance(address, bool):
            raise BundleError("argument tree: $pointer is not an integer", K.SCHEMA)
        if not 0 <= address <= MAX_ADDRESS:
            raise BundleError("argument tree: $pointer is outside [0, 2^64)", K.SCHEMA)
        return Pointer(address)
    if "$opaque" in node:
        return Opaque(str(node["$opaque"]), str(node.get("repr", "")))
    raise BundleError(
        f"argument tree: unknown node type {[str(k)[:40] for k in sorted(node)[:3]]}", K.SCHEMA
    )


def _hold_to_limits(node: Any, depth: int, budget: _Budget | None) -> None:
    """A node's depth against the tree depth limit; with a `budget`, also its share of the
    nodes left and the length of the strings it holds."""
    limits = budget.limits if budget is not None else LIMITS
    if depth >= limits.max_tree_depth + 1:
        raise BundleError(
            f"argument tree is nested deeper than {limits.max_tree_depth} levels", K.LIMIT
        )
    if budget is None:
        return
    if not budget.take():
        raise BundleError(
            f"argument trees of one call hold more than {limits.max_tree_nodes} nodes", K.LIMIT
        )
    strings = [node] if isinstance(node, str) else []
    if isinstance(node, dict):
        strings = [node.get(k) for k in ("$enum", "name", "$opaque", "repr", "$device", "$float")]
    for v in strings:
        if isinstance(v, str) and len(v) > limits.max_string:
            raise BundleError(
                f"argument tree holds a string of {len(v)} characters (limit {limits.max_string})",
                K.LIMIT,
            )
