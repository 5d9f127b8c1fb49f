"""kdump: record the exact arguments of GPU kernel calls and replay them offline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kdump._version import __version__

if TYPE_CHECKING:
    from kdump.bundle import Bundle, Call, CallRecord, capture_call, load_bundle, pack, save_calls
    from kdump.errors import KdumpError

# Lazy attributes keep `import kdump` (and `kdump --help`) fast and torch-free.
_LAZY = {
    "load_bundle": "kdump.bundle",
    "save_calls": "kdump.bundle",
    "capture_call": "kdump.bundle",
    "pack": "kdump.bundle",
    "Bundle": "kdump.bundle",
    "Call": "kdump.bundle",
    "CallRecord": "kdump.bundle",
    "KdumpError": "kdump.errors",
    "recording": "kdump.record.session",
    "dump_call": "kdump.record.one_call",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kdump' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
