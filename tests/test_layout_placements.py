"""Exact layout (strides, storage offsets, shared storages, alignment) in every replay placement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, load_bundle, save_calls
from kdump.bundle.capture import capture
from kdump.bundle.materialize import Placement, materialize
from kdump.cli import main
from kdump.format.records import ALIGN_MOD, PREFIX_LIMIT
from kdump.replay import replay

TESTS = Path(__file__).parent
PLACEMENTS = {
    "default": Placement(),
    "halo": Placement(halo=4096, halo_fill=0xA5),
    "flush_end": Placement(flush_end=True, halo_fill=0xA5),
}


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )


def _shared_views(device: str) -> list[torch.Tensor]:
    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(7)).to(device)
    # An input, an output at offset 8 rows in, and a transposed view: all one storage.
    return [base[3:20, 2:30], base[8 + 20 : 8 + 36, :16], base[40:60, 5:9].t()]


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_materialize_keeps_offsets_and_aliasing_in_every_placement(name: str) -> None:
    placement = PLACEMENTS[name]
    views = _shared_views("cpu")
    cap = capture(views)
    assert cap.storages[0].span_start > 0  # the views leave an unrecorded prefix
    mat = materialize(cap.storages, cap.tensors, lambda i: cap.data[i], "cpu", placement)
    assert mat.offset_changes == []
    ptrs = {t.untyped_storage().data_ptr() for t in mat.tensors}
    assert len(ptrs) == 1
    for got, want in zip(mat.tensors, views):
        assert got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        if not placement.flush_end:  # a flush end keeps the alignment only where it can
            assert got.data_ptr() % ALIGN_MOD == want.data_ptr() % ALIGN_MOD
        assert torch.equal(got, want)
    [alloc] = mat.allocations
    prefix = alloc.buffer[alloc.span_offset - alloc.prefix : alloc.span_offset]
    assert prefix.numel() == cap.storages[0].span_start
    fill = 0 if name == "default" else 0xA5
    assert bool((prefix == fill).all())
    if placement.flush_end:
        assert alloc.span_offset + alloc.span_nbytes == alloc.buffer.numel()


def test_prefix_past_the_budget_reports_the_changed_offsets() -> None:
    deep = PREFIX_LIMIT + (1 << 20)
    big = torch.empty(deep // 4 + 64, dtype=torch.float32)
    a = big[deep // 4 : deep // 4 + 16].copy_(torch.randn(16))
    small = torch.randn(64)[8:24]
    cap = capture([small, a])
    for placement in PLACEMENTS.values():
        mat = materialize(cap.storages, cap.tensors, lambda i: cap.data[i], "cpu", placement)
        assert [(c.tensor, c.recorded, c.placed) for c in mat.offset_changes] == [(1, deep // 4, 0)]
        assert mat.tensors[0].storage_offset() == 8
        assert torch.equal(mat.tensors[1], a) and torch.equal(mat.tensors[0], small)
        assert "storage offset" in mat.offset_changes[0].describe("a")


def _record_layout_call(path: Path, device: str) -> Path:
    from targets import layout_check

    x, out = layout_check.views(device)
    target = "targets.layout_check:double_checked"
    call = capture_call(target, [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    layout_check.double_checked(x, out)
    attach_outputs(call, live, [1])
    save_calls(path, [call])
    return path


def test_cli_replay_of_layout_checking_target_with_default_halo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _record_layout_call(tmp_path / "layout.kdump", "cpu")
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--device", "cpu", "--allow-target", "targets.layout_check:*"])
    assert exc.value.code == 0, capsys.readouterr()
    [v] = replay([path], device="cpu", halo=0, allow_targets=("targets.layout_check:*",))
    assert v.exit_code == 0, v.headline()


def test_bundle_round_trip_keeps_layout_under_halo_and_flush(tmp_path: Path) -> None:
    path = _record_layout_call(tmp_path / "layout.kdump", "cpu")
    from targets import layout_check

    call = load_bundle(path).calls[0]
    for placement in PLACEMENTS.values():
        mc = call.materialize("cpu", placement)
        x, out = mc.tensors
        assert (x.storage_offset(), out.storage_offset()) == (
            layout_check.X_OFFSET,
            layout_check.OUT_OFFSET,
        )
        layout_check.double_checked(x, out)  # raises if the layout changed
        assert torch.equal(out, 2 * x)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "graph", "sanitizer"])
def test_gpu_replay_keeps_layout_in_every_mode(tmp_path: Path, mode: str) -> None:
    if mode == "sanitizer":
        from kdump.cuda.tools import find_tool

        if find_tool("compute-sanitizer") is None:
            pytest.skip("compute-sanitizer is not installed on this machine")
    path = _record_layout_call(tmp_path / "layout.kdump", "cuda")
    [v] = replay([path], mode=mode, repeat=1, allow_targets=("targets.layout_check:*",))
    assert v.exit_code == 0, v.headline()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_gpu_materialize_keeps_offsets_and_aliasing(name: str) -> None:
    views = _shared_views("cuda")
    cap = capture(views)
    mat = materialize(cap.storages, cap.tensors, lambda i: cap.data[i], "cuda", PLACEMENTS[name])
    assert len({t.untyped_storage().data_ptr() for t in mat.tensors}) == 1
    for got, want in zip(mat.tensors, views):
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
        assert torch.equal(got, want)
