"""CPU stand-ins for the graph chain's shrinking-batch and changed-addresses steps
(tests/test_graph_steps.py replays them with a fake captured graph that runs only a function's
"device" part: `REPLAYING` is set while it replays, as no host code runs in a CUDA graph).

- `group_sum(x, groups, out)`: out[g] = the sum of x's rows labelled g; rows labelled < 0 are
  invalid and skipped (the correct kernel).
- `group_sum_cached(x, groups, out)`: the same through a "descriptor" (the tensors to use) that the
  host part writes when the call's addresses change and the device part reads: a replay after an
  eager call on other buffers reads those buffers.
- `group_sum_unchecked(x, groups, out)`: does not skip invalid rows: one labelled -1 "faults"
  (raises, as an illegal address would), so the first shrunk replay fails.
"""

from __future__ import annotations

import torch

REPLAYING = False
_descriptor: dict[str, object] = {}


def group_sum(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    out.zero_()
    keep = groups >= 0
    out.index_add_(0, groups[keep].long(), x[keep])


def group_sum_cached(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    key = (x.data_ptr(), groups.data_ptr(), out.data_ptr())
    if not REPLAYING and _descriptor.get("key") != key:
        _descriptor.update(key=key, x=x, groups=groups, out=out)
    group_sum(_descriptor["x"], _descriptor["groups"], _descriptor["out"])  # type: ignore[arg-type]


def group_sum_unchecked(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    out.zero_()
    if bool((groups < 0).any()):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (row label -1)")
    out.index_add_(0, groups.long(), x)
