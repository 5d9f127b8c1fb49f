"""DeepGEMM's process-global state, for the environment manifest of every bundle.

The DeepGEMM plug-in's state provider (kdump.kernels.deepgemm.plugin). It never imports
DeepGEMM: when no binding module is loaded it reports nothing. Reported:

* which build ran (deepgemm/build.py): distribution, version, commit, file, install kind, and
  how its entry points are bound (`api`: pybind, python, torch.ops, python over torch.ops);
* the JIT settings it runs with (`jit`): whether its JIT is DeepJIT (DG_JIT_* falling back to
  DJ_JIT_*, cache in $HOME/.dj) or older, and each setting with the variable that gave it;
* the getters of names.DEEPGEMM_GETTERS that exist, and the latest arguments of every hooked
  setter (setters without a getter, such as `set_ignore_compile_dims`, are only known this way);
* the locality-domain calls: `localize`, `localize_rows` (sgl-deep-gemm) and
  `destroy_localizer`, by a summary of their arguments
  (never the tensors), and the number of locality domains once the program localized weights
  (asked only then: the query may start DeepGEMM's MLOPart localizer).
"""

from __future__ import annotations

import threading
from typing import Any

from kdump import config
from kdump.kernels.deepgemm import build
from kdump.kernels.deepgemm.names import (
    DEEPGEMM_ENTRY_POINTS,
    DEEPGEMM_GETTERS,
    DEEPGEMM_LOCALITY_CALLS,
)
from kdump.kernels.deepgemm.runtime_bound import loaded_module
from kdump.kernels.deepgemm.signature import runtime_signature, unwrap_hooked

# setter name -> latest value seen (JSON-safe), process-global; written by the setter hooks.
_SETTINGS: dict[str, Any] = {}
_lock = threading.Lock()
_API: dict[int, tuple[Any, str]] = {}  # id(entry point) -> (it, how it is bound)


def _json_safe(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 4 and isinstance(value, (list, tuple)):
        return [_json_safe(v, depth + 1) for v in value]
    if depth < 4 and isinstance(value, dict):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    try:
        return repr(value)[:200]
    except Exception:
        return f"<{type(value).__name__}>"


def _tensor_summary(t: Any) -> dict[str, Any] | str:
    shape = getattr(t, "shape", None)
    if shape is None:
        return _json_safe(t)
    return {"shape": [int(s) for s in shape], "dtype": str(getattr(t, "dtype", "?"))}


def _locality_note(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`localize(t, dim=-2)`, `localize_rows(t)` and `destroy_localizer()`: how often, and the
    last arguments (a tensor by its shape and dtype)."""
    previous = _SETTINGS.get(name)
    calls = previous.get("calls", 0) if isinstance(previous, dict) else 0
    note: dict[str, Any] = {"calls": int(calls) + 1}
    if name in ("localize", "localize_rows"):
        tensor = args[0] if args else kwargs.get("t")
        last: dict[str, Any] = {"tensor": _tensor_summary(tensor)}
        if name == "localize":
            last["dim"] = _json_safe(args[1] if len(args) > 1 else kwargs.get("dim", -2))
        note["last"] = last
    return note


def note_setter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Keep the latest value of a setter call: the one argument, or {args, kwargs}; for the
    locality-domain calls, a summary (deepgemm/names.DEEPGEMM_LOCALITY_CALLS)."""
    with _lock:
        if name in DEEPGEMM_LOCALITY_CALLS:
            _SETTINGS[name] = _locality_note(name, args, kwargs)
            return
        if len(args) == 1 and not kwargs:
            value = _json_safe(args[0])
        elif not args and len(kwargs) == 1:
            value = _json_safe(next(iter(kwargs.values())))
        else:
            value = {"args": _json_safe(list(args)), "kwargs": _json_safe(kwargs)}
        _SETTINGS[name] = value


def settings() -> dict[str, Any]:
    with _lock:
        return dict(_SETTINGS)


def reset() -> None:
    with _lock:
        _SETTINGS.clear()


def api_of(module: Any) -> str | None:
    """How the module binds its grouped GEMMs: pybind, python, torch.ops, python over
    torch.ops (the first entry point it has, read once per function object)."""
    for canon, aliases in DEEPGEMM_ENTRY_POINTS.items():
        for name in (*aliases, canon):
            fn = getattr(module, name, None)
            if fn is None:
                continue
            fn = unwrap_hooked(fn)
            hit = _API.get(id(fn))
            if hit is not None and hit[0] is fn:
                return hit[1]
            sig = runtime_signature(fn)
            kind = sig.source if sig is not None else type(fn).__name__
            _API[id(fn)] = (fn, kind)
            return kind
    return None


def _getters(module: Any, out: dict[str, Any]) -> None:
    for key, getter in DEEPGEMM_GETTERS.items():
        fn = getattr(module, getter, None)
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped__", fn)  # a hooked getter is called unhooked
        try:
            out[key] = _json_safe(fn())
        except Exception as exc:  # a getter that needs CUDA state may fail: record why
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}


def state() -> dict[str, Any] | None:
    """The provider: None when DeepGEMM is not loaded and no setter was seen."""
    module = loaded_module()
    seen = settings()
    if module is None:
        return {"setters": seen} if seen else None
    line = build.jit_line(module)
    out: dict[str, Any] = {
        "module": getattr(module, "__name__", None),
        "version": _json_safe(getattr(module, "__version__", None)),
        "file": getattr(module, "__file__", None),
        "build": build.module_build(module),
        "api": api_of(module),
        "jit": {"line": line, "settings": config.deepgemm_jit_settings(line != "legacy")},
    }
    _getters(module, out)
    count = getattr(module, "get_num_locality_domains", None)
    if ("localize" in seen or "localize_rows" in seen) and count is not None:
        try:
            out["locality_domains"] = _json_safe(getattr(count, "__wrapped__", count)())
        except Exception as exc:
            out["locality_domains"] = {"error": f"{type(exc).__name__}: {exc}"}
    out["setters"] = seen
    return out
