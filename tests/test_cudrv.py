"""The ctypes entry points of the recorder's per-call driver calls (kdump.record.flight.cudrv):
result codes are checked and named, handles of either kind are plain addresses, and a machine
without libcuda gets None (the cuda-bindings path) instead of an error. Also the device copies'
chain cells, which carry a graph site's done marker to the next snapshot (the GPU side is
tests/test_snapshot_gpu.py)."""

from __future__ import annotations

import ctypes

import pytest

from kdump.cuda.nvrtc import LaunchError
from kdump.record.flight import cudrv


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
        fns = {name: _Fake(code) for name in (*cudrv._SIGNATURES, *cudrv._OPTIONAL)}
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
    """The done-marker chain (kdump.record.flight.devcopy): the first site of a (capture, stream)
    names the cell, later sites of the same pair share it, another capture or stream gets its
    own."""
    from types import SimpleNamespace

    from kdump.record.flight.devcopy import DeviceCopies

    base = 0x7000_0000
    fake = SimpleNamespace(_chains={}, _cells=SimpleNamespace(data_ptr=lambda: base))
    cell = DeviceCopies._chain_cell
    assert cell(fake, 1, 0xA, 0) == base  # capture 1 on stream A: site 0 starts the chain
    assert cell(fake, 1, 0xA, 1) == base  # its next site joins it
    assert cell(fake, 1, 0xB, 2) == base + 16 * 2  # another stream of the same capture
    assert cell(fake, 2, 0xA, 3) == base + 16 * 3  # another capture on the first stream
    assert cell(fake, 1, 0xA, 4) == base
    assert fake._chains == {(1, 0xA): 0, (1, 0xB): 2, (2, 0xA): 3}


def test_a_strided_copy_fills_one_descriptor(fake):
    """d2h_rows: one cuMemcpy2DAsync, device rows to host rows a pitch apart on both sides."""
    fns = fake(0)
    d = cudrv.driver()
    assert d is not None
    d.d2h_rows(0x10000, 0x20000, 1 << 20, 4096, 16, 0x20)
    ((desc, stream),) = fns["copy2d"].calls
    assert stream == 0x20
    m = cudrv.Memcpy2D.from_address(desc)
    assert (m.srcMemoryType, m.dstMemoryType) == (cudrv.MEMORYTYPE_DEVICE, cudrv.MEMORYTYPE_HOST)
    assert (m.srcDevice, m.dstHost, m.srcPitch, m.dstPitch) == (0x20000, 0x10000, 1 << 20, 1 << 20)
    assert (m.WidthInBytes, m.Height, m.srcXInBytes, m.dstY) == (4096, 16, 0, 0)
    fake(1)
    with pytest.raises(LaunchError, match="cuMemcpy2DAsync failed: CUDA_ERROR_INVALID_VALUE"):
        cudrv.driver().d2h_rows(1, 2, 3, 4, 5, 0)


class _Recorded:
    """A driver that only records the copies it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def d2h(self, dst, src, n, stream):
        self.calls.append(("d2h", dst, src, n, stream))

    def d2h_rows(self, dst, src, pitch, n, rows, stream):
        self.calls.append(("rows", dst, src, pitch, n, rows, stream))


def test_a_batch_copies_runs_of_consecutive_slots_as_one_strided_copy_each():
    """DeviceCopies._copy_runs: consecutive slots whose copies lie a slot apart on both sides
    become one strided copy per extent; a gap in the slot order, another extent or another
    number of copies starts a new run; `post` (each entry's last copy) is left to the caller."""
    from types import SimpleNamespace

    from kdump.record.flight.devcopy import DeviceCopies

    sb, addr, twin, side = 1 << 20, 0x7F00_0000_0000, 0x9000_0000, 0x55
    cu = _Recorded()
    fake = SimpleNamespace(
        _cu=cu, _addr=addr, journal=SimpleNamespace(slot_bytes=sb), _strided=True
    )
    fake._copy_run = lambda *a: DeviceCopies._copy_run(fake, *a)

    def entry(i, extents, stream=0xA):
        host = tuple((4096 + i * sb + off, twin + i * sb + off, n) for off, n in extents)
        return (i, (*host, (4096 + i * sb + sb - 32, twin + 1, 8)), stream)

    one = [(512, 3000)]
    two = [(512, 3000), (sb - 128, 64)]
    pending = [
        *(entry(i, one) for i in (4, 5, 6, 7)),  # a run of four
        entry(9, one),  # a gap: a run of its own
        entry(10, [(512, 2000)]),  # another extent
        *(entry(i, two, 0xB) for i in (11, 12)),  # two extents, another stream
        entry(0, two),  # the ring wrapped: not after 12
    ]
    DeviceCopies._copy_runs(fake, pending, side)
    assert cu.calls == [
        ("rows", addr + 4096 + 4 * sb + 512, twin + 4 * sb + 512, sb, 3000, 4, side),
        ("d2h", addr + 4096 + 9 * sb + 512, twin + 9 * sb + 512, 3000, side),
        ("d2h", addr + 4096 + 10 * sb + 512, twin + 10 * sb + 512, 2000, side),
        ("rows", addr + 4096 + 11 * sb + 512, twin + 11 * sb + 512, sb, 3000, 2, side),
        ("rows", addr + 4096 + 12 * sb - 128, twin + 12 * sb - 128, sb, 64, 2, side),
        ("d2h", addr + 4096 + 512, twin + 512, 3000, side),
        ("d2h", addr + 4096 + sb - 128, twin + sb - 128, 64, side),
    ]
    cu.calls.clear()
    DeviceCopies._copy_runs(fake, [], side)
    assert cu.calls == []


def test_a_driver_that_refuses_the_strided_copy_gets_one_copy_per_slot():
    """A refused cuMemcpy2DAsync (nothing enqueued) turns the strided copies off for good: the
    run is copied slot by slot, as later runs are."""
    from types import SimpleNamespace

    from kdump.record.flight.devcopy import DeviceCopies

    class Refusing(_Recorded):
        code = 1

        def d2h_rows(self, *a):
            self.calls.append(("refused",))
            raise cudrv.DriverError("cuMemcpy2DAsync failed", self.code)

    sb, addr, side = 4096, 0x10_0000, 7
    cu = Refusing()
    fake = SimpleNamespace(
        _cu=cu, _addr=addr, journal=SimpleNamespace(slot_bytes=sb), _strided=True
    )
    DeviceCopies._copy_run(fake, cu, ((64, 0x5000, 100),), 3, side)
    DeviceCopies._copy_run(fake, cu, ((64, 0x5000, 100),), 2, side)
    assert not fake._strided
    assert cu.calls == [
        ("refused",),
        *(("d2h", addr + 64 + k * sb, 0x5000 + k * sb, 100, side) for k in range(3)),
        *(("d2h", addr + 64 + k * sb, 0x5000 + k * sb, 100, side) for k in range(2)),
    ]
    # an error of the context (sticky, left by a kernel) is raised, the strided copies stay on
    cu = Refusing()
    cu.code = 700
    fake = SimpleNamespace(
        _cu=cu, _addr=addr, journal=SimpleNamespace(slot_bytes=sb), _strided=True
    )
    with pytest.raises(cudrv.DriverError):
        DeviceCopies._copy_run(fake, cu, ((64, 0x5000, 100),), 3, side)
    assert fake._strided and cu.calls == [("refused",)]


def test_a_stream_write_passes_the_value_after_the_streams_work(fake):
    fns = fake(0)
    d = cudrv.driver()
    assert d is not None
    d.write64(0x20, 0xDEAD_0000, 12345)
    assert fns["write64"].calls == [(0x20, 0xDEAD_0000, 12345, 0)]  # 0: with a memory fence
    fake(1)
    with pytest.raises(LaunchError, match="cuStreamWriteValue64 failed"):
        cudrv.driver().write64(1, 2, 3)


def test_an_eager_done_marker_is_one_stream_write_until_the_driver_refuses_it():
    """DeviceCopies._done_by_write: the call's seq to its trailer's `done` word through the
    journal's device mapping; a refused write turns the writes off for good (the caller then
    launches the marker kernel)."""
    from types import SimpleNamespace

    from kdump.record.flight.devcopy import _DONE_AT, DeviceCopies

    writes: list[tuple] = []

    class Cu:
        refuse = 0

        def write64(self, stream, dst, value):
            if self.refuse:
                raise cudrv.DriverError("cuStreamWriteValue64 failed", self.refuse)
            writes.append((stream, dst, value))

    cu = Cu()
    fake = SimpleNamespace(_cu=cu, _writes=True, _host_dev=0x7000_0000)
    assert DeviceCopies._done_by_write(fake, 0x33, 4096, 17)
    assert writes == [(0x33, 0x7000_0000 + 4096 + _DONE_AT, 17)]
    cu.refuse = 700  # CUDA_ERROR_ILLEGAL_ADDRESS, sticky: the context's error, raised
    with pytest.raises(cudrv.DriverError):
        DeviceCopies._done_by_write(fake, 0x33, 4096, 18)
    assert fake._writes
    cu.refuse = 801  # CUDA_ERROR_NOT_SUPPORTED: this driver cannot write, the kernel instead
    assert not DeviceCopies._done_by_write(fake, 0x33, 4096, 18)
    assert not fake._writes
    cu.refuse = 0
    assert not DeviceCopies._done_by_write(fake, 0x33, 4096, 19)  # not tried again
    assert len(writes) == 1


def test_a_driver_without_the_optional_entry_points_keeps_the_others(fake):
    """An older libcuda without cuMemcpy2DAsync_v2 / cuStreamWriteValue64_v2: the ctypes path
    stays (launches, copies, events); those two calls say the driver refuses them."""
    fns = fake(0)
    fns["copy2d"] = fns["write64"] = None
    d = cudrv.driver()
    assert d is not None
    d.d2h(0x1000, 0x2000, 64, 0x20)
    for call in (lambda: d.d2h_rows(1, 2, 3, 4, 5, 0), lambda: d.write64(0, 1, 2)):
        with pytest.raises(cudrv.DriverError, match="not in this driver") as err:
            call()
        assert err.value.refused


def test_missing_optional_symbols_load_as_none(monkeypatch):
    class Lib:
        def __getattr__(self, name):
            if name in ("cuMemcpy2DAsync_v2", "cuStreamWriteValue64_v2"):
                raise AttributeError(name)
            return _Fake(0)

    monkeypatch.setattr(cudrv, "_fns", None)
    monkeypatch.setattr(cudrv, "_failed", False)
    monkeypatch.setattr(cudrv, "_driver", None)
    monkeypatch.setattr(cudrv.ctypes, "CDLL", lambda name: Lib())
    assert cudrv.available()
    fns = cudrv._load()
    assert fns is not None and fns["copy2d"] is None and fns["write64"] is None
    assert fns["launch"] is not None
