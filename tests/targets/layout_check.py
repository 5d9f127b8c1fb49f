"""A target that checks its arguments' layout, as kernels that take raw pointers do: both views of
one 16 x 16 float32 storage, at their recorded strides and storage offsets."""

from __future__ import annotations

import torch

X_OFFSET = 2 * 16 + 1  # base[2:6, 1:9]
OUT_OFFSET = 8 * 16 + 4  # base[8:12, 4:12]


def views(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.randn(16, 16, device=device)
    return base[2:6, 1:9], base[8:12, 4:12]


def double_checked(x: torch.Tensor, out: torch.Tensor) -> None:
    for name, t, offset in (("x", x, X_OFFSET), ("out", out, OUT_OFFSET)):
        if t.stride() != (16, 1) or t.storage_offset() != offset:
            raise ValueError(f"{name}: stride {t.stride()} offset {t.storage_offset()}")
    if x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        raise ValueError("x and out no longer share a storage")
    out.copy_(x * 2)
