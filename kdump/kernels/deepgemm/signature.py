"""The runtime signature of an installed callable: the parameter names the running build uses.

DeepGEMM's lines bind their entry points in four ways, and `inspect.signature` reads only one:

* pure Python functions (upstream's torch-ops `_C.py`, sgl-deep-gemm's wrappers over TVM-FFI
  or torch.ops, deep_gemm.mega): `inspect.signature`;
* pybind11 functions (upstream 2.x `_C`): no signature object, but pybind writes one as the
  first line of `__doc__` (`name(a: T, b: T = default, ...) -> R`, or numbered lines under
  "Overloaded function."): parsed here, defaults kept as text;
* torch operators (`torch.ops.deep_gemm.<op>`): the schema's arguments;
* shims that forward `*args, **kwargs` to an operator (sgl-kernel's `_wrap_op`): the operator
  found in the shim's closure.

A callable kdump hooked is read through to the original. Nothing here imports torch or the
library: torch operators are recognised by their type's module. Reading never raises; a
callable none of these describe gives None, and the caller falls back to its table.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_OPEN, _CLOSE = "([{<", ")]}>"


@dataclass(frozen=True)
class RuntimeParam:
    name: str
    positional: bool = True  # may be passed by position
    default: str | None = None  # the default as text ('None', "'nk'"); None: required
    has_default: bool = False


@dataclass(frozen=True)
class RuntimeSignature:
    params: tuple[RuntimeParam, ...]
    source: str  # python | pybind | torch.ops | python over torch.ops

    def positional_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.positional)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def unwrap_hooked(fn: Any) -> Any:
    """The object a kdump hook stands for (its HookState's original), else `fn`."""
    st = getattr(fn, "__kdump_state__", None)
    original = getattr(st, "original", None)
    return original if original is not None else fn


def _is_torch_op(fn: Any) -> bool:
    t = type(fn)
    return t.__module__ == "torch._ops" and t.__name__ in ("OpOverloadPacket", "OpOverload")


def _schema_of(op: Any) -> Any:
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return schema
    try:  # a packet: its default overload, else the first one
        names = list(op.overloads())
    except Exception:
        return None
    for name in ("default", *names):
        overload = getattr(op, name, None) if name in names else None
        if overload is not None:
            return getattr(overload, "_schema", None)
    return None


def _from_schema(op: Any) -> RuntimeSignature | None:
    schema = _schema_of(op)
    if schema is None:
        return None
    params = []
    for arg in schema.arguments:
        has_default = bool(arg.has_default_value()) if hasattr(arg, "has_default_value") else False
        default = repr(arg.default_value) if has_default else None
        params.append(
            RuntimeParam(arg.name, not bool(arg.kwarg_only), default, has_default=has_default)
        )
    return RuntimeSignature(tuple(params), "torch.ops")


def _from_inspect(fn: Any) -> RuntimeSignature | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pybind functions, odd callables
        return None
    params = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        has_default = p.default is not p.empty
        default = repr(p.default) if has_default else None
        params.append(RuntimeParam(p.name, positional, default, has_default=has_default))
    if not params and _forwards_everything(sig):
        return None  # a shim: the caller looks behind it
    return RuntimeSignature(tuple(params), "python")


def _forwards_everything(sig: inspect.Signature) -> bool:
    kinds = {p.kind for p in sig.parameters.values()}
    return inspect.Parameter.VAR_POSITIONAL in kinds


def _closure_target(fn: Any) -> Any:
    """The operator or extension function a `*args, **kwargs` shim forwards to, if it holds
    exactly one in its closure."""
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _is_torch_op(value) or _pybind_doc_line(value) is not None:
            found.append(value)
    return found[0] if len(found) == 1 else None


# --- pybind11 docstrings ---------------------------------------------------------------------


def _pybind_doc_line(fn: Any) -> str | None:
    """The signature line of a pybind11 function's docstring, or None."""
    name = getattr(fn, "__name__", None)
    doc = getattr(fn, "__doc__", None)
    if not isinstance(name, str) or not isinstance(doc, str):
        return None
    lines = [ln.strip() for ln in doc.splitlines() if ln.strip()]
    if not lines:
        return None
    if lines[0].startswith(f"{name}(") and "Overloaded function" not in doc[:200]:
        return lines[0]
    for ln in lines:  # overloads: "1. name(...)"; the first one names the parameters
        head, _, rest = ln.partition(". ")
        if head.isdigit() and rest.startswith(f"{name}("):
            return rest
    return None


def _outside_quotes(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """(index, character, bracket depth after it) of each character of `text` from `start`
    that is not inside a quoted string (quotes themselves included)."""
    depth, quote = 0, ""
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        yield i, ch, depth


def split_top_level(text: str) -> list[str]:
    """`text` split at commas outside brackets and quotes."""
    parts, start = [], 0
    for i, ch, depth in _outside_quotes(text):
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def _inside_parens(line: str) -> str | None:
    """The text between the signature's outer parentheses."""
    start = line.find("(")
    if start < 0:
        return None
    for i, ch, depth in _outside_quotes(line, start):
        if ch in _CLOSE and depth == 0:
            return line[start + 1 : i]
    return None


def parse_pybind_signature(line: str) -> RuntimeSignature | None:
    """`name(a: T, b: T = d, *, c: T = e) -> R` as parameters (defaults as text)."""
    inner = _inside_parens(line)
    if inner is None:
        return None
    params, keyword_only = [], False
    for item in split_top_level(inner):
        if item == "*":
            keyword_only = True
            continue
        if item == "/" or item.startswith("*"):
            continue  # positional-only marker, *args, **kwargs
        head, eq, default = _split_default(item)
        name = head.partition(":")[0].strip()
        if not name.isidentifier():
            return None
        params.append(
            RuntimeParam(name, not keyword_only, default.strip() if eq else None, has_default=eq)
        )
    return RuntimeSignature(tuple(params), "pybind")


def _split_default(item: str) -> tuple[str, bool, str]:
    """'name: T = value' -> ('name: T', True, 'value'); '=' inside brackets is not a split."""
    depth, quote = 0, ""
    for i, ch in enumerate(item):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif ch == "=" and depth == 0:
            return item[:i], True, item[i + 1 :]
    return item, False, ""


# --- the entry point -------------------------------------------------------------------------


def runtime_signature(fn: Any) -> RuntimeSignature | None:
    """How the installed build names `fn`'s parameters (see the module docstring), or None."""
    try:
        return _read(unwrap_hooked(fn), depth=0)
    except Exception:  # reading a signature must never break recording
        return None


def _read(fn: Any, depth: int) -> RuntimeSignature | None:
    if _is_torch_op(fn):
        return _from_schema(fn)
    sig = _from_inspect(fn)  # Python functions, builtins with a text signature
    if sig is not None:
        return sig
    line = _pybind_doc_line(fn)  # only where inspect cannot: a Python docstring never counts
    if line is not None:
        return parse_pybind_signature(line)
    target = _closure_target(fn) if depth == 0 else None
    if target is not None:
        inner = _read(target, depth + 1)
        if inner is not None and inner.source == "torch.ops":
            return RuntimeSignature(inner.params, "python over torch.ops")
        return inner
    return None


def positional_names(fn: Any) -> tuple[str, ...] | None:
    """The positional parameter names of `fn` in the running build, or None."""
    sig = runtime_signature(fn)
    names = sig.positional_names() if sig is not None else ()
    return names or None
