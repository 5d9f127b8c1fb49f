"""Plug-in-free targets for the standalone repro script's tests (tests/test_repro_script.py):
a correct kernel, a regressed build of it, one that raises, and a capture-unsafe GPU kernel."""

from __future__ import annotations

import torch

_rows: dict[str, torch.Tensor] = {}


def scale_rows(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, factor: float) -> None:
    """out[r] = x[r] * factor for rows with a label >= 0, zero elsewhere (capture-safe)."""
    keep = (labels >= 0).to(x.dtype).unsqueeze(1)
    out.copy_(x * factor * keep)


def scale_rows_regressed(
    x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, factor: float
) -> None:
    """A later build of scale_rows that gets the last column wrong."""
    scale_rows(x, labels, out, factor)
    out[:, -1] += 1.0


def scale_rows_fault(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, factor: float):
    raise RuntimeError("planted kernel fault")


def scale_rows_capture_unsafe(
    x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, factor: float
) -> None:
    """Finds the kept rows on the host outside capture and reuses the last ones inside it: the
    graph bakes in the capture-time routing, so a replay with other labels is wrong."""
    if not torch.cuda.is_current_stream_capturing():
        _rows["last"] = torch.nonzero(labels >= 0).flatten()
    rows = _rows["last"]
    out.zero_()
    out.index_copy_(0, rows, x.index_select(0, rows) * factor)


def layout_probe(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    """Writes what a raw-pointer kernel sees of its two inputs: storage offsets, addresses
    modulo 1024, strides and whether they share one allocation."""
    shared = x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    seen = [x.storage_offset(), x.data_ptr() % 1024, *x.stride()]
    seen += [y.storage_offset(), y.data_ptr() % 1024, *y.stride(), int(shared)]
    out.copy_(torch.tensor(seen, dtype=out.dtype))
