"""The flight recorder keeps outputs on a GPU: a generic target (torch ops) recorded eagerly and
through a CUDA graph replayed after its input changed in place; the salvaged bundle of the last
replay holds that replay's outputs (copied by captured nodes after the kernel), with and without
a salvage process holding the device tier (host copies on a side branch, or before the kernel)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.bundle.inspect import recorded_outputs
from kdump.record.config import RingConfig

pytestmark = pytest.mark.gpu
T = __name__


def triple(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 3, out=out)


def _fn() -> Any:
    return sys.modules[T].triple  # by attribute at call time: the recorder's hook


def _ring() -> RingConfig:
    return RingConfig(slots=16, slot_bytes=256 << 10, journal_dir=Path("/dev/shm"))


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_eager_call_keeps_its_outputs(tmp_path):
    x = torch.arange(64.0, device="cuda")
    out = torch.zeros(64, device="cuda")
    with kdump.recording(f"{T}:triple", out=tmp_path / "out", mode="ring", ring=_ring()) as rec:
        _fn()(x, out)
        torch.cuda.synchronize()
        rec.flush()
        (path,) = rec.written
    with load_bundle(path) as b:
        call = b.calls[0]
        assert recorded_outputs(call) == ["x", "out"]  # every tensor argument, as sync mode
        assert call.meta["journal"]["outputs"]["changed"] == 1  # out; x was only read
        assert torch.equal(call.outputs["out"], (x * 3).cpu())
        assert torch.equal(call.args[1], torch.zeros(64))  # before the call


@pytest.mark.parametrize("held", [False, True])
def test_graph_replay_bundle_holds_that_replays_outputs(tmp_path, held):
    x = torch.randn(32, 16, device="cuda")
    out = torch.zeros(32, 16, device="cuda")
    with kdump.recording(f"{T}:triple", out=tmp_path / "out", mode="ring", ring=_ring()) as rec:
        fn = _fn()
        fn(x, out)  # eager, on the buffers the graph is captured over
        cuda = rec.recorder._cuda
        assert cuda is not None
        if cuda.tier is not None:
            cuda.tier.held = held  # as if a salvage process held it (side-branch host copies)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(x, out)
        fed = []
        for step in range(4):
            x.copy_(torch.full_like(x, float(step + 1)) + torch.arange(16, device="cuda"))
            fed.append(x.clone())
            g.replay()
        torch.cuda.synchronize()
        rec.flush()
        written = list(rec.written)
    replays = [p for p in written if "graph_replay" in load_bundle(p).info]
    assert len(replays) == 1, written
    with load_bundle(replays[0]) as b:
        call = b.calls[-1]
        assert call.meta["journal"]["replay"] >= 4
        assert torch.equal(call.args[0], fed[-1].cpu())  # the snapshot before the kernel
        assert recorded_outputs(call) == ["x", "out"], call.meta["journal"]
        # the copy after the kernel, refreshed by the last replay
        assert torch.equal(call.outputs["out"], (fed[-1] * 3).cpu())
        # before that replay, out held the previous replay's result
        assert torch.equal(call.args[1], (fed[-2] * 3).cpu())
