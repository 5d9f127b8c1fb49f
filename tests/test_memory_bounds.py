"""Memory proportional to what is asked: a call's tensors are materialised when used and released
after, so iterating over a bundle of many calls holds one call's tensors at a time."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kdump.bundle import capture_call, load_bundle, save_calls

PAGE = os.sysconf("SC_PAGE_SIZE")
CALLS = 3000
SPAN = 1 << 20  # bytes of each call's one tensor: 3,000 calls would hold 3 GB
GROWTH_LIMIT = 64 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _shared_blob_bundle(path: Path) -> Path:
    """3,000 calls whose one tensor is the same bytes (one blob), at a storage offset so that
    each materialisation is a copy of its own (not a map of the file)."""
    base = torch.ones(SPAN // 4 + 3)
    rec = capture_call("kd_memory_probe:fn", [base[3:]], {}, names=["x"])
    return save_calls(path, [rec] * CALLS)


def test_iterating_args_of_many_calls_stays_bounded(tmp_path: Path) -> None:
    bundle = load_bundle(_shared_blob_bundle(tmp_path / "many.kdump"))
    assert len(bundle.calls) == CALLS and len(bundle.blobs) == 1
    assert bundle.file_size < 8 << 20
    assert bundle.calls[0].args[0].storage_offset() == 3  # a copy with its prefix, not a map
    start = _rss()
    growth = 0
    for call in bundle.calls:
        x = call.args[0]
        assert x.shape == (SPAN // 4,) and float(x[-1]) == 1.0
        growth = max(growth, _rss() - start)
        assert growth < GROWTH_LIMIT, f"grew {growth >> 20} MiB by call {call.index}"


def test_args_and_kwargs_of_one_call_share_one_materialisation(tmp_path: Path) -> None:
    base = torch.arange(16, dtype=torch.float32)
    rec = capture_call("kd_memory_probe:fn", [base[:8]], {"out": base[4:]}, names=["x"])
    bundle = load_bundle(save_calls(tmp_path / "alias.kdump", [rec, rec]))
    first, second = bundle.calls
    x, out = first.args[0], first.kwargs["out"]
    assert x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()  # aliasing kept
    assert first.args[0] is x  # asked again: the same tensors
    y = second.args[0]
    assert y.data_ptr() != x.data_ptr()
    assert torch.equal(x, y) and torch.equal(out, base[4:])
    # The caller's own references stay valid after the bundle moved on.
    assert float(x[7]) == 7.0
