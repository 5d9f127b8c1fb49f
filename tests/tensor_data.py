"""Random tensor data shared by the bundle and tensor tests."""

from __future__ import annotations

import math

import torch

# Every dtype a round trip must keep bit-exact.
ROUND_TRIP_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def random_bits(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    generator: torch.Generator | None = None,
    device: str = "cpu",
) -> torch.Tensor:
    """Random bits of `dtype` (every bit pattern: NaN, inf and every fp8 code); bool as 0/1."""
    n = math.prod(shape)
    if dtype == torch.bool:
        flags = torch.randint(0, 2, (n,), dtype=torch.uint8, generator=generator, device=device)
        return flags.bool().reshape(shape)
    raw = torch.randint(
        0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=generator, device=device
    )
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes in logical order (for bitwise comparison, NaNs included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
