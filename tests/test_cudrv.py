"""The ctypes entry points of the recorder's per-call driver calls (kdump.record.cudrv): result
codes are checked and named, handles of either kind are plain addresses, and a machine without
libcuda gets None (the cuda-bindings path) instead of an error. Also the device copies' chain
cells, which carry a graph site's done marker to the next snapshot (the GPU side is
tests/test_snapshot_gpu.py)."""

from __future__ import annotations

import ctypes

import pytest

from kdump.nvrtc import LaunchError
from kdump.record import cudrv


class _Fake:
    """Stands in for libcuda's functions: records each call, returns `code`."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)
        return self.code


def _error_name(code, out):
    names = {1: b"CUDA_ERROR_INVALID_VALUE", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}
    if code not in names:
        return 100
    ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = names[code]
    return 0


@pytest.fixture
def fake(monkeypatch):
    def install(code: int) -> dict:
        fns = {name: _Fake(code) for name in cudrv._SIGNATURES}
        fns["error_name"] = _error_name
        monkeypatch.setattr(cudrv, "_fns", fns)
        monkeypatch.setattr(cudrv, "_driver", None)
        return fns

    return install


def test_calls_pass_plain_integers_and_succeed_on_zero(fake):
    fns = fake(0)
    d = cudrv.driver()
    assert d is not None
    args = (ctypes.c_void_p * 1)(0)
    d.launch(0x10, 7, 256, args, 0x20, "snapshot")
    d.d2h(0x1000, 0x2000, 64, 0x20)
    d.record(0x30, 0x20)
    d.wait(0x20, 0x30)
    (launch,) = fns["launch"].calls
    assert launch[:9] == (0x10, 7, 1, 1, 256, 1, 1, 0, 0x20) and launch[10] is None
    assert fns["d2h"].calls == [(0x1000, 0x2000, 64, 0x20)]
    assert fns["wait"].calls == [(0x20, 0x30, 0)]


@pytest.mark.parametrize(
    ("code", "text"),
    [(700, "cuLaunchKernel(snapshot) failed: CUDA_ERROR_ILLEGAL_ADDRESS"), (999, "CUDA error 999")],
)
def test_a_failed_call_raises_with_the_drivers_name(fake, code, text):
    fake(code)
    d = cudrv.driver()
    assert d is not None
    with pytest.raises(LaunchError, match=text.replace("(", r"\(").replace(")", r"\)")):
        d.launch(1, 1, 1, None, 0, "snapshot")
    with pytest.raises(LaunchError, match="cuMemcpyDtoHAsync failed"):
        d.d2h(1, 2, 3, 0)


def test_without_libcuda_the_caller_gets_none(monkeypatch):
    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cudrv, "_fns", None)
    monkeypatch.setattr(cudrv, "_failed", False)
    monkeypatch.setattr(cudrv, "_driver", None)
    monkeypatch.setattr(cudrv.ctypes, "CDLL", missing)
    assert not cudrv.available()
    assert cudrv.driver() is None
    with pytest.raises(LaunchError, match="not loadable"):
        cudrv.Driver()


def test_handles_of_either_kind_are_addresses():
    class Obj:
        def __int__(self) -> int:
            return 0x1234

    assert cudrv.handle(0x99) == 0x99
    assert cudrv.handle(Obj()) == 0x1234


def test_graph_sites_share_one_chain_cell_per_capture_and_stream():
    """The done-marker chain (kdump.record.devcopy): the first site of a (capture, stream) names
    the cell, later sites of the same pair share it, another capture or stream gets its own."""
    from types import SimpleNamespace

    from kdump.record.devcopy import DeviceCopies

    base = 0x7000_0000
    fake = SimpleNamespace(_chains={}, _cells=SimpleNamespace(data_ptr=lambda: base))
    cell = DeviceCopies._chain_cell
    assert cell(fake, 1, 0xA, 0) == base  # capture 1 on stream A: site 0 starts the chain
    assert cell(fake, 1, 0xA, 1) == base  # its next site joins it
    assert cell(fake, 1, 0xB, 2) == base + 16 * 2  # another stream of the same capture
    assert cell(fake, 2, 0xA, 3) == base + 16 * 3  # another capture on the first stream
    assert cell(fake, 1, 0xA, 4) == base
    assert fake._chains == {(1, 0xA): 0, (1, 0xB): 2, (2, 0xA): 3}
