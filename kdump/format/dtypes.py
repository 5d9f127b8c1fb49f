"""The format's dtype names and the torch dtypes they stand for: the one table, built on first use
(torch is imported then, not when this module is), for the argument tree and the tensor layouts.
"""

from __future__ import annotations

from typing import Any

from kdump.errors import BundleError
from kdump.format.records import DTYPE_SIZES

_BY_NAME: dict[str, Any] = {}  # format name -> torch.dtype, for every name this torch has
_BY_DTYPE: dict[Any, str] = {}


def _fill() -> None:
    import torch

    for name in DTYPE_SIZES:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            _BY_NAME[name] = dtype
            _BY_DTYPE[dtype] = name


def torch_dtypes() -> dict[str, Any]:
    """Every dtype a bundle may hold that this torch has, by its stable name in the format."""
    if not _BY_NAME:
        _fill()
    return _BY_NAME


def dtype_name(dtype: Any) -> str:
    try:
        return _BY_DTYPE[dtype]  # filled once: a dict lookup on the recorders' path
    except KeyError:
        if not _BY_DTYPE:
            _fill()
            return dtype_name(dtype)
        raise BundleError(f"dtype {dtype} is not supported by the kdump format") from None


def dtype_from_name(name: str) -> Any:
    table = torch_dtypes()
    try:
        return table[name]
    except (KeyError, TypeError):
        raise BundleError(f"unknown dtype {name!r} in bundle (this kdump knows {sorted(table)})")
