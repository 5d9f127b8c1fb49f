"""Planted wrong DeepGEMM builds for `kdump slim`'s tests. Each folder under
tests/targets/planted_*/ holds a `deep_gemm` package backed by one of these; a test puts the
folder on the path and replays with `--backend library`.

- `routing`: the torch reference, then the rows of the highest group with tokens get +1000. It
  depends only on the routing, so any data shows it.
- `zero_rows`: +1000 only on rows of A that belong to a group but are all zero bytes: it depends
  on the data, so synthetic activations hide it.
"""

from __future__ import annotations

from typing import Any

import torch


def grouped_contiguous(
    bug: str, a: Any, b: Any, d: torch.Tensor, grouped_layout: torch.Tensor, *args: Any, **kw: Any
) -> None:
    from kdump.kernels.generic import ReferenceBackend
    from kdump.kernels.registry import spec_for

    spec = spec_for("deep_gemm:m_grouped_fp8_fp4_gemm_nt_contiguous")
    ReferenceBackend().resolve(spec, spec.id)(a, b, d, grouped_layout, *args, **kw)
    labels = grouped_layout.long()
    if bug == "routing":
        rows = labels == int(labels.max())
    else:
        rows = (labels >= 0) & (a[0].view(torch.uint8) == 0).all(dim=1)
    d[rows] = d[rows] + 1000.0
