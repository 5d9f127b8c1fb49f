"""Exact-layout capture and re-materialisation (kdump.bundle.tensors, capture, materialize),
without a file in between."""

from __future__ import annotations

import pytest
import torch
from tensor_data import ROUND_TRIP_DTYPES, bits, random_bits

from kdump.bundle.capture import capture
from kdump.bundle.materialize import Placement, materialize
from kdump.bundle.tensors import DTYPES, group_storages
from kdump.errors import BundleError
from kdump.format.records import ALIGN_MOD, StorageRecord, TensorRecord, view_byte_extent
from kdump.format.validate import validate_records

GEN = torch.Generator().manual_seed(1234)


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return random_bits(shape, dtype, generator=GEN)


def assert_same_layout_and_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.storage_offset() == want.storage_offset()
    assert bits(got) == bits(want)


def layouts(dtype: torch.dtype) -> list[torch.Tensor]:
    """Views a kernel sees in practice: slices, transposes, expands, TMA-padded scales, offsets."""
    base = rand((16, 24), dtype)
    m, kb = 30, 5
    tma = torch.empty_strided((m, kb), (1, (m + 3) // 4 * 4), dtype=dtype)
    tma.copy_(rand((m, kb), dtype))
    return [
        base[2:14:3, 1::2],  # non-contiguous slice
        rand((12, 20), dtype).t(),  # transposed
        rand((5, 1), dtype).expand(5, 7),  # stride 0
        tma,  # [M, K/128] with stride(-1) = align(M, 4)
        rand((300_000,), dtype)[200_001:200_101],  # large storage offset
        rand((), dtype),  # 0-d
        rand((10,), dtype)[3],  # 0-d view at an offset
        rand((0, 5), dtype),  # empty
        base[:, 4:4],  # empty view of a non-empty storage
    ]


def round_trip(tensors: list[torch.Tensor], placement: Placement | None = None, device="cpu"):
    cap = capture(tensors)
    return cap, materialize(cap.storages, cap.tensors, lambda i: cap.data[i], device, placement)


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_capture_materialize_every_dtype_and_layout(dtype: torch.dtype) -> None:
    tensors = layouts(dtype)
    cap, mat = round_trip(tensors)
    for got, want in zip(mat.tensors, tensors):
        assert_same_layout_and_bits(got, want)
    # captured spans are copies: mutating the originals later does not change the snapshot
    before = bits(mat.tensors[0])
    raw = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
    raw.bitwise_not_()
    _, again = round_trip(tensors)
    assert bits(again.tensors[0]) != before
    cap2 = materialize(cap.storages, cap.tensors, lambda i: cap.data[i])
    assert bits(cap2.tensors[0]) == before


def test_span_is_the_hull_of_the_views_not_the_storage() -> None:
    base = rand((1000,), torch.float32)
    a, b = base[100:200], base[150:300:2]
    storages, records = group_storages([a, b])
    assert len(storages) == 1 and records[0].storage == records[1].storage == 0
    st = storages[0]
    assert (st.span_start, st.span_nbytes) == (400, (298 + 1 - 100) * 4)
    assert st.storage_nbytes == 4000 and st.base_ptr == base.untyped_storage().data_ptr()
    assert records[1].storage_offset == 150 and records[1].stride == (2,)
    assert view_byte_extent((3, 4), (1, 3), 2, 4) == (8, (2 + 2 + 9 + 1) * 4)
    assert view_byte_extent((3, 0), (1, 3), 2, 4) == (8, 8)
    assert view_byte_extent((), (), 5, 2) == (10, 12)


def test_aliasing_survives() -> None:
    base = rand((8, 8), torch.float32)
    data = rand((64,), torch.float8_e4m3fn)
    pair = (data[:48].view(6, 8), data[48:].view(torch.uint8))  # (data, scale) in one allocation
    tensors = [base, base[2:6, 1:5], base.t(), base[3], pair[0], pair[1]]
    _, mat = round_trip(tensors)
    t = mat.tensors
    ptr = {x.untyped_storage().data_ptr() for x in t[:4]}
    assert len(ptr) == 1, "a view and its base must share one storage after loading"
    t[1][0, 0] = 42.0  # writes base[2, 1]
    assert t[0][2, 1] == 42.0 and t[2][1, 2] == 42.0
    t[3][:] = -1.0
    assert torch.all(t[0][3] == -1.0) and torch.all(t[1][1] == -1.0)
    assert t[4].untyped_storage().data_ptr() == t[5].untyped_storage().data_ptr()
    orig = bits(data)
    t[5][0] = 0x7E
    assert bits(data) == orig, "the loaded copy must not write into the recorded tensor"
    # the (data, scale) pair still lives in one allocation, scale right after data
    assert t[5].data_ptr() == t[4].data_ptr() + 48


def test_overlapping_views_overlap_the_same_way() -> None:
    base = rand((100,), torch.int32)
    a, b = base[10:60], base[40:90]
    _, mat = round_trip([a, b])
    ga, gb = mat.tensors
    assert gb.data_ptr() - ga.data_ptr() == 30 * 4
    ga[35] = 777  # base[45] = b[5]
    assert gb[5].item() == 777


@pytest.mark.parametrize("offset", [0, 1, 3, 17, 250])
def test_alignment_modulo_1024_recreated(offset: int) -> None:
    big = rand((4096,), torch.float32)
    views = [big[offset : offset + 300], big[offset + 700 : offset + 1700].view(-1, 2)]
    cap, mat = round_trip(views)
    recorded = [r.data_ptr % ALIGN_MOD for r in cap.tensors]
    assert recorded == [v.data_ptr() % ALIGN_MOD for v in views]
    assert [t.data_ptr() % ALIGN_MOD for t in mat.tensors] == recorded
    alloc = mat.allocations[0]
    assert alloc.span_ptr % ALIGN_MOD == cap.storages[0].alignment


def test_flush_end_places_span_end_at_allocation_end() -> None:
    x = rand((64, 33), torch.bfloat16)
    tensors = [x[5:40, 1:30], rand((77,), torch.uint8)[3:]]
    _, mat = round_trip(tensors, Placement(flush_end=True))
    for alloc in mat.allocations:
        end = alloc.buffer.data_ptr() + alloc.buffer.numel()
        assert alloc.span_ptr + alloc.span_nbytes == end
    for got, want in zip(mat.tensors, tensors):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert bits(got) == bits(want)
        # the last element the view can touch is the allocation's last byte
    last = mat.tensors[1]
    assert last.data_ptr() + last.numel() == end


@pytest.mark.parametrize("halo", [1, 64, 4096])
def test_halo_is_filled_around_each_span(halo: int) -> None:
    tensors = [rand((50, 6), torch.float32).t(), rand((33,), torch.int64)]
    _, mat = round_trip(tensors, Placement(halo=halo, halo_fill=0xA5))
    for alloc in mat.allocations:
        before = alloc.buffer[alloc.span_offset - halo : alloc.span_offset]
        after_start = alloc.span_offset + alloc.span_nbytes
        after = alloc.buffer[after_start : after_start + halo]
        assert before.numel() == halo and after.numel() == halo
        assert torch.all(before == 0xA5) and torch.all(after == 0xA5)
    for got, want in zip(mat.tensors, tensors):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert bits(got) == bits(want)


def test_large_prefix_is_rebased_not_allocated() -> None:
    # A view deep into a huge storage: the unrecorded prefix (> 64 MiB) is not re-created.
    st = StorageRecord("cpu", 1 << 40, 200 << 20, 100 << 20, 16, "")
    rec = TensorRecord(0, "float32", (4,), (1,), (100 << 20) // 4, data_ptr=(1 << 40) + (100 << 20))
    payload = rand((16,), torch.uint8)
    mat = materialize([st], [rec], lambda i: payload)
    assert mat.allocations[0].buffer.numel() < (1 << 20)
    assert bits(mat.tensors[0]) == bits(payload)
    assert mat.tensors[0].data_ptr() % ALIGN_MOD == rec.data_ptr % ALIGN_MOD


def _records(shape, stride, offset, dtype="float32", span=(0, 64)):
    return [StorageRecord("cpu", 4096, 1024, span[0], span[1], "")], [
        TensorRecord(0, dtype, shape, stride, offset)
    ]


@pytest.mark.parametrize(
    ("shape", "stride", "offset", "dtype", "match"),
    [
        ((4, 4), (4, 1), 1, "float32", "outside the stored span"),  # 17 elements > 16
        ((4, 4), (1, 5), 0, "float32", "outside the stored span"),
        ((-1, 4), (4, 1), 0, "float32", "negative or absurd"),
        ((4,), (-1,), 0, "float32", "negative or absurd"),
        ((4,), (1 << 60,), 0, "float32", "negative or absurd"),
        ((4,), (1,), -3, "float32", "invalid storage offset"),
        ((4, 4), (1,), 0, "float32", "do not match"),
        ((1,) * 17, (1,) * 17, 0, "float32", "do not match"),
        ((4,), (1,), 0, "float128", "unknown dtype"),
    ],
)
def test_validate_records_rejects(shape, stride, offset, dtype, match) -> None:
    storages, tensors = _records(shape, stride, offset, dtype)
    with pytest.raises(BundleError, match=match):
        validate_records(storages, tensors)


def test_validate_records_accepts_exact_fit_and_rejects_missing_storage() -> None:
    storages, tensors = _records((4, 4), (4, 1), 0)
    validate_records(storages, tensors)
    storages, tensors = _records((4, 4), (4, 1), 4, span=(16, 64))  # offset relative to storage
    validate_records(storages, tensors)
    bad = [TensorRecord(3, "float32", (1,), (1,), 0)]
    with pytest.raises(BundleError, match="does not exist"):
        validate_records(storages, bad)


def test_materialize_rejects_wrong_blob_size() -> None:
    storages, tensors = _records((4,), (1,), 0, span=(0, 16))
    with pytest.raises(BundleError, match="blob holds 8 bytes"):
        materialize(storages, tensors, lambda i: torch.ones(8, dtype=torch.uint8))


def test_every_format_dtype_name_round_trips() -> None:
    for name, dtype in DTYPES.items():
        assert str(dtype) == f"torch.{name}"


def test_prefix_budget_is_per_call() -> None:
    # Two views 40 MiB deep into their storages: only the first prefix fits the 64 MiB budget.
    deep = 40 << 20
    storages = [StorageRecord("cpu", 1 << 40, deep + 64, deep, 64, "") for _ in range(2)]
    recs = [TensorRecord(i, "int32", (16,), (1,), deep // 4) for i in range(2)]
    payload = rand((64,), torch.uint8)
    mat = materialize(storages, recs, lambda i: payload)
    assert mat.tensors[0].storage_offset() == deep // 4  # exact
    assert mat.tensors[1].storage_offset() == 0  # rebased onto its span
    assert mat.allocations[1].buffer.numel() < (1 << 20)
    assert bits(mat.tensors[0]) == bits(mat.tensors[1]) == bits(payload)
