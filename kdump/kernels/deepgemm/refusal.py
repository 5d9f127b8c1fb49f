"""The DeepGEMM calls kdump records but cannot replay, and the one line that says why.

* An `epilogue` that is a Python callable: replaying it would run code taken from the bundle
  (kdump never does), and the bundle holds only its type and repr anyway.
* An `epilogue` object kdump could not serialise (DeepGEMM's `deep_gemm.epilogue.*` classes are
  extension objects without readable fields): recorded by type and repr, which cannot rebuild
  it. `None` and plain values (strings, numbers, enums, tuples) replay as given.
* The mega-MoE kernels: they read and write other ranks' symmetric memory through raw
  addresses (`sym_buffer_ptrs`, or the symmetric buffer object holding them); that memory is
  not in the bundle, and an address from another process means nothing here.

Every check accepts decoded values (argtree.Opaque, argtree.Pointer, live objects) and the
bundle's encoded trees ({"$opaque": ...}, {"$pointer": ...}), so a replay can refuse before it
materialises anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kdump.text import visible

# Recorded types that are callables (argtree records an object by its type's qualified name).
_CALLABLE_TYPES = frozenset(
    {
        "builtins.function",
        "builtins.builtin_function_or_method",
        "builtins.method",
        "builtins.method-wrapper",
        "builtins.method_descriptor",
        "builtins.wrapper_descriptor",
        "builtins.cython_function_or_method",
        "functools.partial",
        "torch._ops.OpOverloadPacket",
        "torch._ops.OpOverload",
    }
)


def _opaque(value: Any) -> tuple[str, str] | None:
    """(type, repr) of an argument recorded by its repr only, encoded or decoded."""
    if isinstance(value, dict) and "$opaque" in value:
        return str(value.get("$opaque")), str(value.get("repr", ""))
    cls = getattr(value, "cls", None)
    rep = getattr(value, "repr", None)
    if type(value).__name__ == "Opaque" and isinstance(cls, str) and isinstance(rep, str):
        return cls, rep
    return None


def _is_pointer(value: Any) -> bool:
    if isinstance(value, dict) and "$pointer" in value:
        return True
    return type(value).__name__ == "Pointer" and isinstance(getattr(value, "address", None), int)


def _is_callable_type(cls: str) -> bool:
    return cls in _CALLABLE_TYPES or cls.endswith((".function", "_function", ".partial"))


def epilogue_refusal(function: str, value: Any) -> str | None:
    """Why a call with this `epilogue` cannot be replayed, or None (None, plain values)."""
    if value is None:
        return None
    op = _opaque(value)
    if op is not None:
        cls, rep = op
        if _is_callable_type(cls):
            return (
                f"{function} was called with a Python callable as its epilogue ({visible(cls, 80)}"
                f" {visible(rep, 80)}); kdump never runs code taken from a bundle, so this call "
                "cannot be replayed"
            )
        return (
            f"{function}'s epilogue is a {visible(cls, 80)} object that kdump recorded by its "
            f"repr only ({visible(rep, 80)}) and cannot rebuild, so this call cannot be replayed"
        )
    if callable(value) and not isinstance(value, type):
        name = f"{type(value).__module__}.{type(value).__qualname__}"
        return (
            f"{function} was called with a Python callable as its epilogue ({visible(name, 80)}); "
            "kdump never runs code taken from a bundle, so this call cannot be replayed"
        )
    return None


def _pointers(value: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 8:
        return
    if _is_pointer(value):
        yield value
    elif isinstance(value, dict) and "$tuple" in value:
        for v in value.get("$tuple") or ():
            yield from _pointers(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _pointers(v, depth + 1)


def count_pointers(bound: dict[str, Any]) -> int:
    """Raw addresses among a call's arguments (encoded or decoded)."""
    return sum(1 for v in bound.values() for _ in _pointers(v))


def mega_moe_refusal(function: str, bound: dict[str, Any]) -> str:
    """The one line every mega-MoE replay ends with."""
    n = count_pointers(bound)
    held = (
        f"sym_buffer_ptrs: {n} raw address{'es' if n != 1 else ''} recorded as opaque pointers"
        if n
        else "the symmetric buffer object that holds their addresses"
    )
    return (
        f"{function} reads and writes other ranks' symmetric memory through raw pointers "
        f"({held}); that memory is not in the bundle and belongs to processes that are gone, "
        "so a mega-MoE call cannot be replayed on its own"
    )
