"""Scale-factor formats of DeepGEMM's FP8 GEMMs, and the layout helpers they need.

Two formats exist:

* SM90 format: float32 scales. A: one per token per K block, [.., M, ceil(K/gk)], which DeepGEMM
  wants MN-major and TMA-aligned (stride(-2) = 1, stride(-1) = align(M, 4)). B: one per 128x128
  block, [G, ceil(N/128), ceil(K/128)].
* SM100/SM120 format: UE8M0 exponents (value 2^(byte - 127)) packed four per int32,
  [.., MN, ceil(K/(4 gk))], MN-major with stride(-1) = align(MN, 4); byte j (little-endian) of word
  w is the exponent of K block 4w + j. Granularity (1, gk) on both operands ("1D1D").
"""

from __future__ import annotations

import sys
from enum import Enum

import torch

TMA_ALIGNMENT_BYTES = 16  # TMA needs 16-byte aligned global strides
UE8M0_BIAS = 127
_UE8M0_ZERO_BITS = 0x00400000  # float32 bits of 2^-127 (a subnormal): what byte 0 means
_FP32_NAN_BITS = 0x7FC00000  # byte 255 is NaN in UE8M0


FP4_BLOCK_K = 32  # an e2m1 operand's UE8M0 scale covers 32 K elements
# e2m1 magnitudes by their three low bits; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_packed_fp4(t: torch.Tensor) -> bool:
    """Packed FP4 as DeepGEMM takes it: two e2m1 values a byte, in int8 (uint8 in older
    builds; torch's float4_e2m1fn_x2 where it exists)."""
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    return t.dtype in (torch.int8, torch.uint8) or (fp4x2 is not None and t.dtype == fp4x2)


def logical_k(t: torch.Tensor) -> int:
    """Elements along the last dimension: twice the bytes for packed FP4."""
    return int(t.shape[-1]) * (2 if is_packed_fp4(t) else 1)


def unpack_fp4(t: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [.., K/2] -> float32 [.., K]; the low nibble of a byte is the even element."""
    by = t.view(torch.uint8).to(torch.int32) if t.dtype != torch.uint8 else t.to(torch.int32)
    nib = torch.stack([by & 0x0F, by >> 4], dim=-1).flatten(-2)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=t.device)
    mag = values[nib & 0x07]
    return torch.where((nib & 0x08) != 0, -mag, mag)


class ScaleFormat(str, Enum):
    FP32 = "fp32"  # SM90 format, float32 scales
    UE8M0 = "ue8m0"  # SM100/SM120 format, packed int32


def align(x: int, a: int) -> int:
    """`x` rounded up to a multiple of `a`."""
    return (x + a - 1) // a * a


def ceil_div(x: int, a: int) -> int:
    return (x + a - 1) // a


def tma_aligned_size(mn: int, element_size: int) -> int:
    """Rows an MN-major scale column occupies so that the next column starts 16-byte aligned."""
    return align(mn, TMA_ALIGNMENT_BYTES // element_size)


def format_of(scale: torch.Tensor) -> ScaleFormat | None:
    """The format a scale tensor is in, from its dtype (None for anything else)."""
    if scale.dtype == torch.float32:
        return ScaleFormat.FP32
    if scale.dtype == torch.int32:
        return ScaleFormat.UE8M0
    return None


def empty_mn_major(
    batch: tuple[int, ...], mn: int, kb: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A [*batch, mn, kb] tensor in DeepGEMM's MN-major TMA-aligned layout.

    stride(-2) = 1, stride(-1) = tma_aligned_size(mn), stride(-3) = stride(-1) * kb. The padding
    rows are zeroed so that captured storage spans are deterministic.
    """
    esize = torch.empty((), dtype=dtype).element_size()
    rows = tma_aligned_size(mn, esize)
    base = torch.zeros((*batch, kb, rows), dtype=dtype, device=device)
    return base.transpose(-1, -2)[..., :mn, :]


def to_mn_major(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` ([.., mn, kb]) in the MN-major TMA-aligned layout."""
    out = empty_mn_major(tuple(x.shape[:-2]), x.shape[-2], x.shape[-1], x.dtype, x.device)
    out.copy_(x)
    return out


def is_mn_major_tma_aligned(x: torch.Tensor) -> bool:
    """Whether `x` has exactly the strides DeepGEMM checks for packed scales."""
    if x.dim() < 2:
        return False
    mn, kb = x.shape[-2], x.shape[-1]
    if x.stride(-2) != 1 and mn != 1:
        return False
    if x.stride(-1) != tma_aligned_size(mn, x.element_size()) and kb != 1:
        return False
    return not (x.dim() >= 3 and x.shape[-3] > 1 and x.stride(-3) != x.stride(-1) * kb)


def is_power_of_two_scale(sf: torch.Tensor) -> torch.Tensor:
    """Elementwise: is this float32 value exactly representable in UE8M0 (2^e, e in [-127, 127])?"""
    bits = sf.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    sign_ok = bits >= 0
    normal = (exp > 0) & (exp < 255) & (mant == 0)
    smallest = (exp == 0) & (mant == _UE8M0_ZERO_BITS)
    return sign_ok & (normal | smallest)


def ue8m0_bytes(sf: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (uint8) of power-of-two float32 scales; raises ValueError otherwise."""
    if sf.dtype != torch.float32:
        raise ValueError(f"UE8M0 packing takes float32 scales, got {sf.dtype}")
    ok = is_power_of_two_scale(sf)
    if not bool(ok.all()):
        bad = sf.contiguous().view(-1)[~ok.view(-1)][0].item()
        raise ValueError(
            f"scale {bad!r} is not a power of two in [2^-127, 2^127]: UE8M0 cannot hold it "
            "(round scales up to a power of two first)"
        )
    exp = (sf.contiguous().view(torch.int32) >> 23) & 0xFF
    return exp.to(torch.uint8)


def pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales [.., mn, kb] -> packed int32 [.., mn, ceil(kb/4)] in the
    MN-major TMA-aligned layout. K blocks past kb are padded with byte 0."""
    if sys.byteorder != "little":  # the packing is defined on little-endian words
        raise RuntimeError("UE8M0 packing assumes a little-endian host")
    *batch, mn, kb = sf.shape
    kw = ceil_div(kb, 4)
    by = torch.zeros((*batch, mn, kw * 4), dtype=torch.uint8, device=sf.device)
    by[..., :kb] = ue8m0_bytes(sf)
    words = by.view(torch.int32)  # last dim kw*4 bytes -> kw little-endian words
    return to_mn_major(words)


def unpack_ue8m0(packed: torch.Tensor, kb: int | None = None) -> torch.Tensor:
    """Packed int32 [.., mn, kw] (any strides) -> float32 [.., mn, kb] (kb defaults to 4*kw)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed UE8M0 scales are int32, got {packed.dtype}")
    kw = packed.shape[-1]
    kb = 4 * kw if kb is None else kb
    if not 0 <= kb <= 4 * kw:
        raise ValueError(f"{kw} packed words hold at most {4 * kw} K blocks, asked for {kb}")
    # A fresh tensor with standard strides: .contiguous() keeps odd strides on size-1 dims,
    # which view(uint8) refuses.
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    flat = dense.view(-1).view(torch.uint8)
    by = flat.view(*packed.shape[:-1], kw * 4)[..., :kb].to(torch.int32)
    bits = by << 23
    bits = torch.where(by == 0, torch.full_like(bits, _UE8M0_ZERO_BITS), bits)
    bits = torch.where(by == 255, torch.full_like(bits, _FP32_NAN_BITS), bits)
    return bits.view(torch.float32)


def round_up_to_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= sf (elementwise, sf > 0): how DeepGEMM's UE8M0 recipes round."""
    return torch.exp2(torch.ceil(torch.log2(sf.to(torch.float32))))
