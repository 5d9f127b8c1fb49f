"""The committed sample bundles load, are valid calls, and hold the reference as their output."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import load_bundle
from kdump.kernels.generic import GenericSpec
from kdump.kernels.registry import spec_for
from kdump.replay.metrics import calc_diff

CAPTURES = Path(__file__).resolve().parent.parent / "captures"
NAMES = [
    "contiguous_ue8m0",
    "contiguous_ue8m0_b",
    "contiguous_fp32",
    "masked_ue8m0",
    "contiguous_psum_fp32",
]


def _assert_same_result(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to BLAS differences between machines (seen: AMD + torch 2.13 vs Intel + torch
    2.11): fp32 sums may round differently in the last bits, which moves a bf16 value by at most
    one ulp (or a little, absolutely, where the sum cancels); almost all values are identical."""
    g, w = got.double(), want.double()
    assert calc_diff(g, w) < 1e-6
    atol = 1e-4 * w.pow(2).mean().sqrt().item()  # fp32 sums that cancel to near zero
    assert bool(((g - w).abs() <= 2.0**-7 * w.abs() + atol).all())
    assert (got == want).double().mean().item() > 0.99


def _load(name: str):
    bundle = load_bundle(CAPTURES / f"{name}.kdump")
    assert len(bundle.calls) == 1
    call = bundle.calls[0]
    spec = spec_for(call.target, call.names)
    assert not isinstance(spec, GenericSpec)
    return bundle, call, spec, spec.bind(call.args, call.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_capture_is_valid_and_output_is_the_reference(name):
    bundle, call, spec, bound = _load(name)
    bundle.verify()
    assert call.meta["synthetic"] is True and call.meta["output"] == "reference"
    assert spec.validate(bound) == []
    recorded = call.outputs["d"]
    ref = spec.reference(bound)["d"]
    mask = spec.meaningful(bound, "d").expand_as(ref)
    assert 0 < int(mask.sum()) < mask.numel()  # real padding / masked rows
    _assert_same_result(recorded[mask], ref[mask])
    assert bool(recorded[~mask].isnan().all())  # rows a kernel does not own stay untouched
    # There is an empty group in every sample.
    assert 0 in call.meta["generator"]["group_sizes"]
    if spec.masked:
        assert int((bound["masked_m"] == 0).sum()) >= 1
    elif not bound["use_psum_layout"]:
        labels = bound["grouped_layout"]
        counts = torch.bincount(labels[labels >= 0].long(), minlength=bound["b"][0].shape[0])
        assert int((counts == 0).sum()) >= 1


def test_second_call_has_same_shapes_and_weights_other_routing():
    _, c1, _, b1 = _load("contiguous_ue8m0")
    _, c2, _, b2 = _load("contiguous_ue8m0_b")
    for t1, t2 in zip(c1.tensors, c2.tensors):
        assert (t1.dtype, t1.shape, t1.stride) == (t2.dtype, t2.shape, t2.stride)
    assert torch.equal(b1["b"][0].view(torch.uint8), b2["b"][0].view(torch.uint8))
    assert torch.equal(b1["b"][1], b2["b"][1])
    assert not torch.equal(b1["grouped_layout"], b2["grouped_layout"])


def test_capture_sizes():
    sizes = {n: (CAPTURES / f"{n}.kdump").stat().st_size for n in NAMES}
    assert all(s <= 5 * 1000 * 1000 for s in sizes.values())
    assert sum(sizes.values()) <= 12 * 1000 * 1000


def test_make_captures_is_deterministic(tmp_path, monkeypatch):
    spec_ = importlib.util.spec_from_file_location("make_captures", CAPTURES / "make_captures.py")
    mod = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, "make_captures", mod)  # dataclasses look the module up
    spec_.loader.exec_module(mod)
    written = mod.make(tmp_path)
    assert [p.stem for p in written] == NAMES
    for p in written:
        fresh = load_bundle(p).calls[0]
        committed = load_bundle(CAPTURES / p.name).calls[0]
        assert fresh.encoded_args == committed.encoded_args
        assert fresh.encoded_kwargs == committed.encoded_kwargs
        # inputs: the same bytes (blob hashes); outputs: the reference, up to BLAS rounding
        assert [s.blob for s in fresh.storages] == [s.blob for s in committed.storages], p.name
        got, want = fresh.outputs["d"], committed.outputs["d"]
        written_rows = ~want.isnan()
        assert torch.equal(written_rows, ~got.isnan())
        _assert_same_result(got[written_rows], want[written_rows])
