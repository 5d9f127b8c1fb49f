"""Bundles captured from CUDA tensors, materialised on CUDA: layout, alignment, aliasing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensor_data import ROUND_TRIP_DTYPES, bits, random_bits

from kdump.bundle import Placement, capture_call, load_bundle, save_calls
from kdump.format.records import ALIGN_MOD

pytestmark = pytest.mark.gpu

DTYPES = ROUND_TRIP_DTYPES


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return random_bits(shape, dtype, device="cuda")


def cuda_layouts(dtype: torch.dtype) -> list[torch.Tensor]:
    base = rand((64, 48), dtype)
    m, kb = 30, 5
    tma = torch.empty_strided((m, kb), (1, (m + 3) // 4 * 4), dtype=dtype, device="cuda")
    tma.copy_(rand((m, kb), dtype))
    return [
        base[3:50:2, 7:],
        base.t(),
        rand((6, 1), dtype).expand(6, 9),
        tma,
        rand((300_000,), dtype)[100_003:100_103],
        rand((), dtype),
        rand((0, 4), dtype),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    ts = cuda_layouts(dtype)
    path = save_calls(tmp_path / "g.kdump", [capture_call("m:f", ts)])
    call = load_bundle(path).calls[0]
    assert all(st.device.startswith("cuda") for st in call.storages)
    mc = call.materialize("cuda")
    for got, want, rec in zip(mc.args, ts, call.tensors):
        assert got.is_cuda
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert got.storage_offset() == want.storage_offset()
        assert bits(got) == bits(want)
        if got.numel():
            assert got.data_ptr() % ALIGN_MOD == rec.data_ptr % ALIGN_MOD == want.data_ptr() % 1024
    # aliasing: base[3:50:2, 7:] and base.t() share one CUDA buffer after loading
    a, t = mc.args[0], mc.args[1]
    assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    before = bits(t[7, 3])  # the element a[0, 0] = base[3, 7]
    raw = torch.empty(0, dtype=torch.uint8, device="cuda").set_(a.untyped_storage())
    raw[a.storage_offset() * a.element_size()] ^= 1
    assert bits(t[7, 3]) != before


def test_cuda_aliasing_visible(tmp_path: Path) -> None:
    base = torch.randn(128, 64, device="cuda")
    q = rand((8192,), torch.float8_e4m3fn)
    args = [base[16:80], base.t(), (q[:6144].view(48, 128), q[6144:].view(torch.uint8)), base[40]]
    path = save_calls(tmp_path / "g.kdump", [capture_call("m:f", args)])
    x, xt, (d, s), row = load_bundle(path).calls[0].materialize("cuda").args
    x[24, 5] = 123.0  # base[40, 5]
    torch.cuda.synchronize()
    assert xt[5, 40].item() == 123.0 and row[5].item() == 123.0
    assert s.data_ptr() == d.data_ptr() + 6144
    assert d.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()


def test_cuda_flush_end_and_halo(tmp_path: Path) -> None:
    x = torch.randn(1000, 37, device="cuda")[5:900, 3:30]
    path = save_calls(tmp_path / "g.kdump", [capture_call("m:f", [x])])
    call = load_bundle(path).calls[0]
    mc = call.materialize("cuda", Placement(flush_end=True))
    alloc = mc.materialized.allocations[0]
    assert alloc.buffer.is_cuda
    assert alloc.span_ptr + alloc.span_nbytes == alloc.buffer.data_ptr() + alloc.buffer.numel()
    assert bits(mc.args[0]) == bits(x) and mc.args[0].stride() == x.stride()
    mh = call.materialize("cuda", Placement(halo=4096))
    h = mh.materialized.allocations[0]
    assert torch.all(h.buffer[h.span_offset - 4096 : h.span_offset] == 0xFF).item()
    end = h.span_offset + h.span_nbytes
    assert torch.all(h.buffer[end : end + 4096] == 0xFF).item()
    assert bits(mh.args[0]) == bits(x)
