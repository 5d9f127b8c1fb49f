"""Triton kernels recorded on a GPU (compiled, not interpreted): a launch captured into a CUDA
graph with the flight recorder, the graph replayed on changed inputs, the salvaged bundle of
the last replay holds that replay's arguments and outputs and the launch record; a sync
recording of an autotuned kernel with two configs records one call per real launch (never the
benchmark's), with the chosen config; a raw device address passed as an int is marked."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.kernels.triton import launch as tl_launch
from kdump.record.config import RingConfig

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

KERNELS = """
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.autotune(
    configs=[
        triton.Config({"BLOCK": 128}, num_warps=4),
        triton.Config({"BLOCK": 256}, num_warps=8),
    ],
    key=["n"],
)
@triton.jit
def scale_kernel(x_ptr, out_ptr, n, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * s, mask=mask)


@triton.jit
def neg_kernel(x_ptr, out_ptr, n, addr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, -tl.load(x_ptr + offs, mask=mask), mask=mask)
"""

_names = itertools.count()


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh module of compiled Triton kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name = f"kd_tkern_gpu_{os.getpid()}_{next(_names)}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def _ring() -> RingConfig:
    return RingConfig(slots=16, slot_bytes=1 << 20, journal_dir=Path("/dev/shm"))


def test_graph_replays_of_a_triton_kernel_salvage_the_last_replay(tmp_path, kernels):
    m = kernels
    n, block = 4096, 256
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.zeros(n, device="cuda")
    calls = []

    def grid(meta: dict[str, Any]) -> tuple[int]:
        calls.append(1)
        return (-(-meta["n"] // meta["BLOCK"]),)

    target = f"{m.__name__}:add_kernel"
    with kdump.recording(target, out=tmp_path / "out", mode="ring", ring=_ring()) as rec:
        m.add_kernel[grid](x, y, out, n, BLOCK=block)  # eager: compiles, makes the journal
        torch.cuda.synchronize()
        assert torch.equal(out, x + y)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            m.add_kernel[grid](x, y, out, n, BLOCK=block)
        fed = []
        for step in range(4):
            x.copy_(torch.full_like(x, float(step + 1)) + torch.arange(n, device="cuda"))
            fed.append(x.clone())
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fed[-1] + y)  # the program's own result, unchanged by kdump
        rec.flush()
        written = list(rec.written)
    assert len(calls) == 2  # once per launch: the grid function is not run again by kdump
    replays = [p for p in written if "graph_replay" in load_bundle(p).info]
    assert len(replays) == 1, written
    sha = tl_launch.source_sha256(tl_launch.innermost(m.add_kernel))
    with load_bundle(replays[0]) as b:
        call = b.calls[-1]
        assert call.target == target
        assert list(call.names) == ["x_ptr", "y_ptr", "out_ptr", "n"]
        assert call.encoded_kwargs == {"BLOCK": block}
        launch = call.launch
        assert launch is not None and launch.kind == "triton"
        assert launch.grid == (n // block,)
        assert launch.constexprs == ("BLOCK",)
        assert launch.source_sha256 == sha
        assert call.meta["journal"]["replay"] >= 4
        assert torch.equal(call.args[0], fed[-1].cpu())  # the last replay's input
        assert torch.equal(call.args[1], y.cpu())
        # outputs kept by default, refreshed by the last replay after the kernel
        assert torch.equal(call.outputs["out_ptr"], (fed[-1] + y).cpu())
    eager = [p for p in written if p not in replays]
    assert eager, written
    with load_bundle(eager[0]) as b:
        assert b.calls[0].launch is not None and b.calls[0].launch.grid == (n // block,)


def test_sync_autotuned_kernel_records_each_real_launch_with_the_chosen_config(tmp_path, kernels):
    m = kernels
    n = 1 << 16
    x = torch.randn(n, device="cuda")
    out = torch.zeros(n, device="cuda")
    target = f"{m.__name__}:scale_kernel"
    with kdump.recording(target, out=tmp_path / "out", mode="sync") as rec:
        for s in (2.0, 3.0, 4.0):  # the first launch benchmarks both configs many times
            m.scale_kernel[lambda meta: (-(-meta["n"] // meta["BLOCK"]),)](x, out, n, s)
            torch.cuda.synchronize()
            assert torch.equal(out, x * s)
        written = list(rec.written)
    assert len(written) == 3, written  # one bundle per real launch, none for the benchmark
    best = m.scale_kernel.best_config
    for p, s in zip(sorted(written), (2.0, 3.0, 4.0)):
        with load_bundle(p) as b:
            call = b.calls[0]
            assert call.encoded_kwargs == {"BLOCK": best.kwargs["BLOCK"]}
            assert call.launch.options["num_warps"] == best.num_warps
            assert call.launch.options["num_stages"] == best.num_stages
            assert call.launch.grid == (n // best.kwargs["BLOCK"],)
            assert call.args[3] == s
            assert torch.equal(call.outputs["out_ptr"], (x * s).cpu())


def test_a_device_address_passed_as_an_int_is_marked(tmp_path, kernels):
    m = kernels
    x = torch.arange(256.0, device="cuda")
    out = torch.zeros(256, device="cuda")
    elsewhere = torch.zeros(1024, device="cuda")  # no argument of the launch
    target = f"{m.__name__}:neg_kernel"
    with kdump.recording(target, out=tmp_path / "out", mode="sync") as rec:
        m.neg_kernel[(2,)](x, out, 256, elsewhere.data_ptr() + 64, BLOCK=128)
        m.neg_kernel[(2,)](x, out, 256, 1 << 20, BLOCK=128)  # a plain integer
        torch.cuda.synchronize()
        written = sorted(rec.written)
    assert torch.equal(out, -x)
    with load_bundle(written[0]) as b:
        call = b.calls[0]
        assert call.encoded_args[3] == {"$pointer": elsewhere.data_ptr() + 64}
        assert call.meta["notes"][0].startswith("opaque-pointer: addr ")
    with load_bundle(written[1]) as b:
        assert b.calls[0].encoded_args[3] == 1 << 20
        assert "notes" not in b.calls[0].meta
