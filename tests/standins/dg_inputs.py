"""Random inputs for the grouped-GEMM stand-in (never all zeros; FP8 clamped to ±448)."""

from __future__ import annotations

from typing import Any

import torch


def make_contiguous(
    seed: int = 0, groups: int = 4, m_per_group: int = 64, n: int = 64, k: int = 128
) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = groups * m_per_group
    kb, nb = (k + 127) // 128, (n + 127) // 128
    a = (
        (torch.randn(m, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(m, kb, generator=g) + 0.5,
    )
    b = (
        (torch.randn(groups, n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(groups, nb, kb, generator=g) + 0.5,
    )
    d = torch.randn(m, n, generator=g).to(torch.bfloat16)  # pre-filled: the call overwrites it
    layout = (torch.arange(m, dtype=torch.int32) // m_per_group).contiguous()
    layout[m_per_group - 5 : m_per_group] = -1  # padding rows at the end of group 0
    return a, b, d, layout
