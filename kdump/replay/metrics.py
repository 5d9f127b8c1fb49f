"""Comparison metrics shared by the replayer and the tests."""

from __future__ import annotations

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """DeepGEMM's metric: 1 - 2·Σxy / Σ(x² + y²), in float64.

    0 means identical; it is scale-free, so one threshold serves any magnitude. With `mask`
    (broadcastable to x) only the selected elements count. Two all-zero tensors give 0.0 (they are
    equal; DeepGEMM's formula would give NaN). A NaN or inf anywhere gives NaN, which fails every
    `<=` threshold.
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ, {tuple(x.shape)} vs {tuple(y.shape)}")
    xd = x.to(torch.float64)
    yd = y.to(torch.float64)
    if mask is not None:
        m = torch.broadcast_to(mask.to(torch.bool), x.shape)
        xd = xd[m]
        yd = yd[m]
    denom = (xd * xd + yd * yd).sum()
    if not bool(torch.isfinite(denom)):
        return float("nan")
    if float(denom) == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (xd * yd).sum() / denom)
