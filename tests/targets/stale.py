"""A stand-in for the motivating bug class, in plain torch: the row schedule is derived from the
routing labels of the FIRST call for a given pair of buffers and reused afterwards (no host sync
after the first call, so it captures in a CUDA graph). Clean in eager with fresh buffers, clean at
capture and identical replay; wrong after the labels change in place."""

from __future__ import annotations

import torch

_schedules: dict[tuple[int, int], torch.Tensor] = {}


def stale_double(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor) -> None:
    key = (out.data_ptr(), labels.data_ptr())
    rows = _schedules.get(key)
    if rows is None:
        rows = torch.nonzero(labels >= 0).flatten()  # host sync: only on the first call
        _schedules[key] = rows
    out.index_copy_(0, rows, x.index_select(0, rows) * 2)
