"""Planted CPU targets for the verdict tests: atomics-like noise, state kept across calls."""

from __future__ import annotations

import torch

_workspaces: dict[int, torch.Tensor] = {}


def atomic_rowsum(x: torch.Tensor, out: torch.Tensor) -> None:
    """Row sums added in a random order each run, as float atomics would: correct, but the last
    bits differ run to run."""
    perm = torch.randperm(x.shape[1])
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for j in perm.tolist():
        acc += x[:, j] * 1.0001
    out.copy_(acc)


def workspace_rows(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor) -> None:
    """Keeps a workspace sized from the routing of its FIRST call per output buffer and reuses it
    (capture-unsafe): later calls with other routing give wrong rows."""
    rows = _workspaces.get(out.data_ptr())
    if rows is None:
        rows = torch.nonzero(labels >= 0).flatten()
        _workspaces[out.data_ptr()] = rows
    out.zero_()
    out.index_copy_(0, rows, x.index_select(0, rows) * 2)


def reset() -> None:
    _workspaces.clear()


def atomic_rowsum_cuda(x: torch.Tensor, out: torch.Tensor) -> None:
    """Row sums by float atomics on the GPU (index_add_ on CUDA adds atomically, in no fixed
    order); capture-safe."""
    rows = torch.arange(x.shape[0], device=x.device).repeat_interleave(x.shape[1])
    out.zero_()
    out.index_add_(0, rows, (x * 1.0001).flatten())
