"""Synthetic m-grouped GEMM calls in the style of DeepGEMM's own tests.

Per-group row counts are drawn as int(expected_m · U(0.7, 1.3)) (optionally with some groups
empty); the contiguous layout pads each group to the mk alignment with -1 labels (psum layout:
cumulative end offsets instead); data is random normal, quantised per token per 128-K block (A) and
per 128x128 block (B) with amax/448 scales, rounded up to powers of two for UE8M0. Values are
clamped to ±448 BEFORE the cast to float8_e4m3fn (torch 2.11 turns overflow into NaN).

All random draws come from one CPU generator seeded with `seed`, so a call is identical on every
device and every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdump.kernels.deepgemm.scales import (
    ScaleFormat,
    align,
    pack_ue8m0,
    round_up_to_ue8m0,
    to_mn_major,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_ALIGNMENT = 128
AMAX_FLOOR = 1e-4  # as DeepGEMM's casts: keeps scales finite for all-zero blocks


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8_e4m3fn (clamp first: torch 2.11 gives NaN on overflow)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scale(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    sf = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return round_up_to_ue8m0(sf) if ue8m0 else sf


def quantize_per_token(
    x: torch.Tensor, gran_k: int = 128, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., R, K] (K % gran_k == 0) -> (fp8 [.., R, K], float32 scales [.., R, K/gran_k])."""
    *lead, r, k = x.shape
    xb = x.to(torch.float32).reshape(*lead, r, k // gran_k, gran_k)
    sf = _scale(xb.abs().amax(dim=-1), ue8m0)
    q = to_fp8(xb / sf.unsqueeze(-1)).reshape(*lead, r, k)
    return q, sf


def quantize_per_block(
    x: torch.Tensor, block: int = 128, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, N, K] -> (fp8 [G, N, K], float32 scales [G, ceil(N/block), K/block])."""
    g, n, k = x.shape
    npad = align(n, block)
    xp = torch.zeros(g, npad, k, dtype=torch.float32, device=x.device)
    xp[:, :n] = x
    xb = xp.view(g, npad // block, block, k // block, block)
    sf = _scale(xb.abs().amax(dim=(2, 4)), ue8m0)
    q = to_fp8(xb / sf[:, :, None, :, None]).view(g, npad, k)[:, :n]
    return q.contiguous(), sf


def draw_group_sizes(
    gen: torch.Generator, num_groups: int, expected_m: int, empty_groups: int = 0
) -> list[int]:
    """int(expected_m · U(0.7, 1.3)) per group (at least 1), then `empty_groups` random groups
    set to 0."""
    u = torch.rand(num_groups, generator=gen, dtype=torch.float64) * 0.6 + 0.7
    sizes = [max(1, int(expected_m * float(v))) for v in u]
    if empty_groups:
        for g in torch.randperm(num_groups, generator=gen)[: min(empty_groups, num_groups)]:
            sizes[int(g)] = 0
    return sizes


def label_layout(sizes: Sequence[int], alignment: int, m: int | None = None) -> torch.Tensor:
    """int32 [M] labels: group g's rows, then -1 up to the next multiple of `alignment`.
    M = Σ align(size) unless given (extra rows are -1)."""
    total = sum(align(s, alignment) for s in sizes)
    m = total if m is None else m
    if total > m:
        raise ValueError(f"groups need {total} rows, only {m} available")
    labels = torch.full((m,), -1, dtype=torch.int32)
    row = 0
    for g, s in enumerate(sizes):
        labels[row : row + s] = g
        row += align(s, alignment)
    return labels


def psum_layout(sizes: Sequence[int], alignment: int) -> torch.Tensor:
    """int32 [G] cumulative end offsets: group g occupies [align(end[g-1]), end[g])."""
    ends = []
    prev = 0
    for g, s in enumerate(sizes):
        start = align(prev, alignment) if g > 0 else 0
        prev = start + s
        ends.append(prev)
    return torch.tensor(ends, dtype=torch.int32)


def psum_rows(ends: Sequence[int], alignment: int) -> int:
    """Rows A needs for a psum layout (the last group's end, aligned)."""
    return align(ends[-1], alignment) if ends else 0


@dataclass(frozen=True)
class Quantized:
    """FP8 operands with float32 scales, before packing into a scale format."""

    a: torch.Tensor
    sfa: torch.Tensor  # [.., M, K/128] float32
    b: torch.Tensor
    sfb: torch.Tensor  # [G, ceil(N/128), K/128] float32


def quantize_pair(
    a: torch.Tensor, b: torch.Tensor, fmt: ScaleFormat, gran_k: int = 128
) -> Quantized:
    ue8m0 = fmt == ScaleFormat.UE8M0
    qa, sfa = quantize_per_token(a, gran_k, ue8m0)
    qb, sfb = quantize_per_block(b, 128, ue8m0)
    return Quantized(qa, sfa, qb, sfb)


def format_scales(q: Quantized, fmt: ScaleFormat, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale tensors exactly as DeepGEMM takes them in format `fmt`.

    fp32: A MN-major TMA-aligned [.., M, KB]; B contiguous [G, ceil(N/128), KB].
    ue8m0: A and B packed int32 MN-major TMA-aligned; B's 128x128 block scales are broadcast to
    every row first (granularity (1, 128)).
    """
    if fmt == ScaleFormat.FP32:
        return to_mn_major(q.sfa), q.sfb.contiguous()
    sfb_rows = q.sfb.repeat_interleave(128, dim=1)[:, :n]
    return pack_ue8m0(q.sfa), pack_ue8m0(sfb_rows)


def normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def empty_output(
    shape: tuple[int, ...], device: torch.device | str, pad_cols: int = 0, fill: float | None = None
) -> torch.Tensor:
    """bf16 output; with `pad_cols` a row-major strided view (stride(-2) = N + pad_cols) of a wider
    buffer. `fill` initialises the whole buffer (deterministic captures); else torch.empty."""
    *lead, n = shape
    full = (*lead, n + pad_cols)
    if fill is None:
        base = torch.empty(full, dtype=torch.bfloat16, device=device)
    else:
        base = torch.full(full, fill, dtype=torch.bfloat16, device=device)
    return base[..., :n] if pad_cols else base
