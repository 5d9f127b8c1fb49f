"""DeepGEMM's process-global settings, for the environment manifest of every bundle.

The DeepGEMM plug-in's state provider (kdump.kernels.deepgemm.plugin). It never imports
DeepGEMM: when no binding module is loaded it reports nothing.
Reported: the getters of kdump.kernels.deepgemm.names.DEEPGEMM_GETTERS that exist, the library's
`__version__` and `__file__`, and the latest arguments of every hooked setter (setters without a
getter, such as `set_ignore_compile_dims`, are only known this way).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from kdump.kernels.deepgemm.names import DEEPGEMM_GETTERS, DEEPGEMM_MODULES

# setter name -> latest value seen (JSON-safe), process-global; written by the setter hooks.
_SETTINGS: dict[str, Any] = {}
_lock = threading.Lock()


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


def note_setter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Keep the latest value of a setter call: the one argument, or {args, kwargs}."""
    if len(args) == 1 and not kwargs:
        value = _json_safe(args[0])
    elif not args and len(kwargs) == 1:
        value = _json_safe(next(iter(kwargs.values())))
    else:
        value = {"args": _json_safe(list(args)), "kwargs": _json_safe(kwargs)}
    with _lock:
        _SETTINGS[name] = value


def settings() -> dict[str, Any]:
    with _lock:
        return dict(_SETTINGS)


def reset() -> None:
    with _lock:
        _SETTINGS.clear()


def state() -> dict[str, Any] | None:
    """The provider: None when DeepGEMM is not loaded and no setter was seen."""
    module = next((sys.modules[m] for m in DEEPGEMM_MODULES if m in sys.modules), None)
    seen = settings()
    if module is None:
        return {"setters": seen} if seen else None
    out: dict[str, Any] = {
        "module": getattr(module, "__name__", None),
        "version": _json_safe(getattr(module, "__version__", None)),
        "file": getattr(module, "__file__", None),
    }
    for key, getter in DEEPGEMM_GETTERS.items():
        fn = getattr(module, getter, None)
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped__", fn)  # a hooked getter is called unhooked
        try:
            out[key] = _json_safe(fn())
        except Exception as exc:  # a getter that needs CUDA state may fail: record why
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    out["setters"] = seen
    return out
