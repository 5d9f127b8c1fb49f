"""The device tier on CPU: row rules against the DeepGEMM reference, gather plans of the real
layouts, the kernel source under NVRTC, and salvage placing rows back from a fake `.cuda0` dump
(overwritten slots and snapshots that did not finish are refused with the reason)."""

from __future__ import annotations

import ctypes
import random
import re
import struct
from pathlib import Path

import pytest
import torch

from kdump.bundle import load_bundle
from kdump.bundle.tensors import group_storages
from kdump.format import argtree
from kdump.format.journal import CALL_RECORD_BYTES, SlotMeta
from kdump.format.records import Source
from kdump.kernels import registry
from kdump.kernels.deepgemm import reference as ref_
from kdump.kernels.deepgemm.scales import align
from kdump.record.flight import announce, devring, gather
from kdump.record.flight.journal import Journal
from kdump.record.flight.salvage import salvage_journal

CONTIG = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
MASKED = "deep_gemm:m_grouped_fp8_gemm_nt_masked"


def _labels(groups: int, sizes: list[int], align_to: int = 128) -> torch.Tensor:
    out = []
    for g, n in enumerate(sizes):
        rows = align(max(n, 1), align_to)
        out += [g] * n + [-1] * (rows - n)
    return torch.tensor(out, dtype=torch.int32)


def _contig_operands(m_sizes: list[int], k: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = _labels(len(m_sizes), m_sizes)
    m = labels.numel()
    a = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    # MN-major fp32 scales: stride(-2) = 1, stride(-1) = align(M, 4)
    sfa = torch.empty_strided((m, k // 128), (1, align(m, 4)), dtype=torch.float32)
    sfa.copy_(torch.randn(m, k // 128, generator=g))
    return a, sfa, labels


def test_row_rules_match_the_deepgemm_reference():
    rng = random.Random(3)
    for _ in range(20):
        sizes = [rng.randrange(0, 200) for _ in range(rng.randrange(1, 9))]
        labels = _labels(len(sizes), sizes)
        got = gather.touched_rows("labels", labels, labels.numel(), labels.numel())
        assert torch.equal(got, labels >= 0)
        max_m = 64
        masked_m = torch.tensor([rng.randrange(0, max_m + 1) for _ in sizes], dtype=torch.int32)
        got = gather.touched_rows("masked", masked_m, len(sizes) * max_m, max_m)
        want = torch.zeros(len(sizes), max_m, dtype=torch.bool)
        for grp in ref_.masked_groups(masked_m, max_m):
            want[grp.batch, grp.sel] = True
        assert torch.equal(got, want.reshape(-1))
        ends, acc = [], 0
        for s in sizes:
            acc = align(acc, 128) + s if ends else s
            ends.append(acc)
        ends_t = torch.tensor(ends, dtype=torch.int32)
        m = align(max(ends[-1], 1), 128)
        got = gather.touched_rows("psum", ends_t, m, m, 128)
        assert torch.equal(got, ref_.psum_row_mask(ends_t, 128, m))


def test_plan_of_fp8_a_and_mn_major_scales_round_trips_rows():
    a, sfa, labels = _contig_operands([3, 0, 130, 1])
    tensors = [a, sfa, labels]
    storages, records = group_storages(tensors)
    plan = gather.make_plan(tensors, records, storages, [0, 1], "labels", 2, 1)
    assert plan is not None and plan.rows == a.shape[0]
    ga, gs = plan.gathers
    assert (ga.cols, ga.elem, ga.inner_stride) == (1, 512, 512)  # one contiguous row
    assert (gs.cols, gs.elem, gs.inner_stride, gs.col_stride) == (4, 4, 4, align(a.shape[0], 4) * 4)
    assert plan.rec_bytes % 16 == 0 and ga.rec_off == gather.RECORD_HEAD
    assert gather.Plan.from_json(plan.to_json()) == plan
    spans = [_span(t, s) for t, s in zip([a, sfa], storages)]
    idx, recs = gather.reference_gather(plan, spans, labels)
    assert idx.tolist() == torch.nonzero(labels >= 0).reshape(-1).tolist()
    back = {i: torch.zeros(storages[i].span_nbytes, dtype=torch.uint8) for i in plan.storages}
    shuffled = recs[torch.randperm(recs.shape[0])]  # blocks finish in any order
    gather.place_back(plan, shuffled, back)
    a2 = _view(back[0], a, storages[0]).view(torch.uint8)
    s2 = _view(back[1], sfa, storages[1])
    keep = labels >= 0
    assert torch.equal(a2[keep], a.view(torch.uint8)[keep])
    assert torch.equal(s2[keep], sfa[keep])
    assert not a2[~keep].any() and not s2[~keep].any()  # rows the call cannot read: zeros


def test_masked_plan_uses_two_row_dims():
    g, max_m, k = 3, 40, 256
    a = torch.randint(0, 256, (g, max_m, k), dtype=torch.uint8)
    masked_m = torch.tensor([5, 0, 40], dtype=torch.int32)
    tensors = [a, masked_m]
    storages, records = group_storages(tensors)
    plan = gather.make_plan(tensors, records, storages, [0], "masked", 1, 2)
    assert plan is not None and (plan.rows, plan.inner) == (g * max_m, max_m)
    _, recs = gather.reference_gather(plan, [_span(a, storages[0])], masked_m)
    assert recs.shape[0] == 45
    back = {0: torch.zeros(storages[0].span_nbytes, dtype=torch.uint8)}
    gather.place_back(plan, recs, back)
    out = back[0].view(g, max_m, k)
    assert torch.equal(out[0, :5], a[0, :5]) and torch.equal(out[2], a[2])
    assert not out[0, 5:].any() and not out[1].any()


def test_plan_refuses_layouts_it_cannot_gather():
    a = torch.zeros(8, 4, 4).permute(0, 2, 1)[:, ::2]  # two strided trailing dims
    storages, records = group_storages([a])
    assert gather.make_plan([a], records, storages, [0], "all", None, 1) is None
    for bad in ({"rule": "x"}, {"rule": "labels", "gathers": []}, [1], None):
        with pytest.raises(ValueError):
            gather.Plan.from_json(bad)


def test_deepgemm_specs_declare_touched_rows():
    spec = registry.spec_for(CONTIG)
    args, kwargs = spec.generate(seed=0, device="cpu", num_groups=2, n=128, k=256, expected_m=8)
    (t,) = spec.touches(spec.bind(args, kwargs))
    assert (t.param, t.rule, t.by) == ("a", "labels", "grouped_layout")
    (t,) = spec.touches(spec.bind(args, {**kwargs, "use_psum_layout": True}))
    assert t.rule == "psum" and t.alignment == spec.mk_alignment
    spec = registry.spec_for(MASKED)
    args, kwargs = spec.generate(seed=0, device="cpu", num_groups=2, n=128, k=256, expected_m=8)
    (t,) = spec.touches(spec.bind(args, kwargs))
    assert (t.rule, t.by, t.row_dims) == ("masked", "masked_m", 2)


def test_params_mirror_the_kernel_struct():
    assert ctypes.sizeof(gather.SnapParams) == 720  # static_assert in snapshot.cu
    assert gather.SnapParams.rule.offset == 16 * 24 + 4 * 48


def test_launch_constants_reach_the_kernel_as_defines():
    """The host sizes the grid from these: the kernel is built with the same values, passed as
    -D flags, and its source defines none of them (no second copy to drift)."""
    src = gather.kernel_source()
    flags = dict(f.split("=", 1) for f in gather.define_flags())
    assert flags == gather.DEFINES
    for name in gather.DEFINES:
        assert not re.search(rf"^\s*#\s*define\s+{name}\b", src, re.M), name
        assert not re.search(rf"#\s*if(n?def)?\b.*\b{name}\b", src), name  # no default
    assert not re.search(r"#\s*ifndef", src)
    assert int(flags["KD_ROWS_PER_BLOCK"]) == gather.ROWS_PER_BLOCK
    assert int(flags["KD_THREADS"]) == gather.THREADS
    assert int(flags["KD_CHUNK"].rstrip("ul")) == gather.COPY_CHUNK
    assert int(flags["KD_MAX_COPIES"]) == gather.MAX_COPIES
    assert int(flags["KD_MAX_GATHERS"]) == gather.MAX_GATHERS
    assert int(flags["KD_PARAMS_BYTES"]) == ctypes.sizeof(gather.SnapParams)


def _nvrtc(defines: dict[str, str], arch: str = "sm_90a") -> bytes:
    cuda_core = pytest.importorskip("cuda.core")
    flags = gather.define_flags(defines)
    opts = cuda_core.ProgramOptions(arch=arch, std="c++17", define_macro=flags)
    return bytes(cuda_core.Program(gather.kernel_source(), "c++", opts).compile("cubin").code)


@pytest.mark.parametrize("name", ["KD_THREADS", "KD_BULK_STAGE", "KD_MIN_BLOCKS_SMALL_SMEM"])
def test_a_missing_define_does_not_compile(name):
    """No default in the source: a build that misses one of the host's constants fails, for
    constants only some archs' code uses too."""
    assert _nvrtc(gather.DEFINES)[:4] == b"\x7fELF"
    with pytest.raises(Exception, match=name):
        _nvrtc({k: v for k, v in gather.DEFINES.items() if k != name})


def test_struct_sizes_are_checked_against_the_host_mirrors():
    """The ctypes mirrors pass their sizes: a mirror that drifts from the kernel's struct fails
    the build instead of launching with a shifted descriptor table."""
    for name in ("KD_PARAMS_BYTES", "KD_MARKS_BYTES", "KD_RECORD_BYTES", "KD_SLOT_HEAD_BYTES"):
        wrong = {**gather.DEFINES, name: str(int(gather.DEFINES[name]) + 8)}
        with pytest.raises(Exception, match="layout"):
            _nvrtc(wrong)


def test_gather_grid_splits_windows_by_their_worst_case_bytes():
    """A window of ROWS_PER_BLOCK rows becomes as many units as it takes for each to copy at
    most KD_SPLIT_BYTES when every row is touched; small records keep one unit per window; the
    blocks are as many as the units, at most what the GPU holds at once."""
    split_bytes = gather.SPLIT_BYTES
    assert split_bytes > 0
    rpb = gather.ROWS_PER_BLOCK
    # A's rows of 4 KiB plus their scales: records of 4,240 bytes
    blocks, split = gather.gather_grid(36_864, 4240)
    assert split == -(-rpb * 4240 // split_bytes) > 1 and blocks == 288 * split
    assert gather.gather_grid(36_864, 4240, resident=528) == (528, split)
    assert gather.gather_grid(36_864, 144) == (288, 1)  # scales only
    assert gather.gather_grid(36_864, 144, resident=100) == (100, 1)
    assert gather.gather_grid(1, 4240) == (split, split)  # one window, partly filled
    assert gather.gather_grid(0, 4240) == (0, 1)
    # never more units than rows in a window, never past the grid's limit or 32-bit unit counts
    assert gather.gather_grid(rpb * 3, 1 << 30) == (3 * rpb, rpb)
    blocks, split = gather.gather_grid((1 << 32) - 1, 1 << 20)
    assert blocks <= gather.MAX_GRID and split >= 1 and -(-((1 << 32) - 1) // rpb) * split < 1 << 32
    # a variant's own constants
    assert gather.gather_grid(1000, 4096, 0, 64, 4096) == (16 * 64, 64)
    assert gather.gather_grid(1000, 4096, 0, 64, 1 << 30) == (16, 1)


def test_set_plan_fills_the_split():
    p = gather.SnapParams()
    gather.set_plan(p, None, lambda i: 0)
    assert (p.gather_blocks, p.split) == (0, 1)


def test_dynamic_shared_memory_holds_the_buffer():
    """kd_snapshot's gather buffer is dynamic shared memory of the size the host launches with:
    too little and the bulk gathers would write past it (the kernel refuses to build then)."""
    src = gather.kernel_source()
    assert "extern __shared__" in src and "s_stage[KD_BUF_WORDS]" not in src
    bulk = gather.BULK_WARPS * gather.BULK_STAGES * gather.BULK_STAGE
    assert gather.SMEM_BYTES == 4 * gather.BUF_WORDS == max(bulk, 4 * gather.STAGE_WORDS)
    # an SM of sm_90 / sm_120 gives one block at most 227 / 99 KiB, static shared memory included
    assert gather.SMEM_BYTES <= 96 * 1024
    small = {**gather.DEFINES, "KD_BUF_WORDS": str(gather.BUF_WORDS // 2)}
    with pytest.raises(Exception, match="the buffer holds"):
        _nvrtc(small)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_snapshot_kernel_compiles_under_nvrtc(arch, tmp_path, monkeypatch):
    pytest.importorskip("cuda.core")
    monkeypatch.setenv("KDUMP_CACHE_DIR", str(tmp_path))
    cubin = gather.build_cubin(arch)
    assert cubin[:4] == b"\x7fELF"
    assert gather.build_cubin(arch) == cubin  # from the cache
    assert gather.cache_path(arch).is_file()
    path = gather.cache_path(arch)
    monkeypatch.setitem(gather.DEFINES, "KD_UNITS", "4")  # another build: another cache entry
    assert gather.cache_path(arch) != path


# -- salvage from a fake device-tier dump -------------------------------------------------------


def _span(t: torch.Tensor, s) -> torch.Tensor:
    u = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return u[s.span_start : s.span_start + s.span_nbytes].clone()


def _view(span: torch.Tensor, like: torch.Tensor, s) -> torch.Tensor:
    isz = like.element_size()
    return (
        span.view(like.dtype)
        .as_strided(like.shape, like.stride(), like.storage_offset() - s.span_start // isz)
        .clone()
    )


_RECORD = struct.Struct("<IIQQQIIQQQ")


def _fake_call(
    tmp_path: Path,
    *,
    head_bump: int = 0,
    seq_off: int = 0,
    complete: bool = True,
    host_copied: bool = True,
    whole: bool = False,
    kernel_done: bool = False,
    empty: bool = False,
    last_row_only: bool = False,
    record_seq: int = 0,
):
    """A journal with one device-path slot and its `.cuda0` dump, as the recorder and the salvage
    process would leave them."""
    a, sfa, labels = _contig_operands([5, 2], k=256, seed=1)
    if empty or last_row_only:  # every group empty: a replay after routing sent no token here
        labels.fill_(-1)
    if last_row_only:  # one token, routed to the buffer's last row
        labels[-1] = 1
    tensors = [a, sfa, labels]
    storages, records = group_storages(tensors)
    plan = gather.make_plan(tensors, records, storages, [0, 1], "labels", 2, 1)
    assert plan is not None
    seen: list[torch.Tensor] = []
    meta = SlotMeta(
        call_index=7,
        target=CONTIG,
        called_as=CONTIG,
        names=None,
        args=[argtree.encode(v, seen) for v in ((a, sfa), labels)],
        storages=[
            {
                "device": "cuda:0",
                "base_ptr": 4096 * (i + 1),
                "storage_nbytes": s.storage_nbytes,
                "span_start": s.span_start,
                "span_nbytes": s.span_nbytes,
            }
            for i, s in enumerate(storages)
        ],
        tensors=[
            {
                "storage": r.storage,
                "dtype": r.dtype,
                "shape": list(r.shape),
                "stride": list(r.stride),
                "storage_offset": r.storage_offset,
                "nbytes": r.numel * r.itemsize,
            }
            for r in records
        ],
        extra={"device": {"device_index": 0, "held": True, "plan": plan.to_json()}},
    )
    spans = [_span(a, storages[0]), _span(sfa, storages[1])]
    layout = []
    if whole:  # the torch fallback: both storages copied whole after the slot header
        at0 = gather.SLOT_HEAD
        at1 = -(-(at0 + spans[0].numel()) // 16) * 16
        layout = [[0, at0, spans[0].numel()], [1, at1, spans[1].numel()]]
        meta.extra["device"]["whole"] = layout
    j = Journal.create(tmp_path / "shm", slots=4, slot_bytes=64 << 10)
    slot = j.reserve(meta, want=[False, False, True])
    slot.payload(2)[:] = labels.numpy().tobytes() if hasattr(labels, "numpy") else bytes(labels)
    slot.commit(device=True)
    marks = ("pre", "post", "done") if host_copied else ("pre", "done") if kernel_done else ("pre",)
    for name in marks:
        slot.marker(name)[:] = struct.pack("<Q", 1)
    _, recs = gather.reference_gather(plan, spans, labels)
    n = recs.shape[0]
    if whole:
        n, recs = 0, torch.zeros(0, dtype=torch.uint8)
    rec_bytes = 0 if whole else plan.rec_bytes
    pos = 4096
    used = -(-(gather.SLOT_HEAD + n * rec_bytes) // 256) * 256
    seq = slot.seq + record_seq  # another seq: the record (and payloads) of an earlier call
    rec = _RECORD.pack(gather.RECORD_MAGIC, n, seq, 1, pos, 0, 0, 1 if complete else 0, 7, 0)
    at = slot.offset + j.slot_bytes - 64 - CALL_RECORD_BYTES
    j._view[at : at + CALL_RECORD_BYTES] = rec
    twin = bytes(j._view[slot.offset : slot.offset + j.slot_bytes])  # what the snapshot wrote
    if not host_copied:  # the crash came before the host copy: the host slot lacks it
        off, size = slot.spans[2]
        j._view[slot.offset + off : slot.offset + off + size] = bytes(size)
        j._view[at : at + CALL_RECORD_BYTES] = bytes(CALL_RECORD_BYTES)
    lay, why = devring.plan_layout(8 << 20, j.slot_count, j.slot_bytes)
    assert lay is not None, why
    raw = bytearray(lay.total)
    raw[devring.HEADER_AT : devring.HEADER_AT + len(lay.header())] = lay.header()
    struct.pack_into("<QQ", raw, 0, pos + used + head_bump, pos + used + head_bump)
    head = struct.pack(
        "<IIQQQIIQQQ",
        gather.SLOT_MAGIC,
        slot.index,
        slot.seq + seq_off,
        1,
        pos,
        n,
        rec_bytes,
        used,
        7,
        1,
    )
    t0 = lay.twin_at + slot.index * j.slot_bytes
    raw[t0 : t0 + j.slot_bytes] = twin
    base = lay.ring_at + pos
    raw[base : base + 64] = head
    raw[base + 64 : base + 64 + recs.numel()] = bytes(recs.reshape(-1).tolist())
    for storage, off, size in layout:
        raw[base + off : base + off + size] = bytes(spans[storage].tolist())
    announce.dump_path(j.path, 0).write_bytes(bytes(raw))
    j.close()
    return j.path, (a, sfa, labels)


def test_salvage_places_gathered_rows_back_from_the_device_dump(tmp_path):
    path, (a, sfa, labels) = _fake_call(tmp_path)
    res = salvage_journal(path, tmp_path / "out")
    (bundle,) = res.bundles
    with load_bundle(bundle) as b:
        call = b.calls[0]
        (a2, s2), lab = call.args[0], call.args[1]
        keep = labels >= 0
        assert torch.equal(a2.view(torch.uint8)[keep], a.view(torch.uint8)[keep])
        assert not a2.view(torch.uint8)[~keep].any()
        assert torch.equal(s2[keep], sfa[keep]) and torch.equal(lab, labels)
        facts = call.meta["journal"]["device"]
        assert facts["rows_kept"] == int(keep.sum()) and "zero-filled" in facts["untouched_rows"]
        # A and its scales hold only the touched rows' bytes
        a_st, s_st = call.storages[0], call.storages[1]
        assert a_st.source is Source.SPARSE and s_st.source is Source.SPARSE
        assert a_st.held_nbytes == int(keep.sum()) * a.shape[1]
        assert s_st.held_nbytes == int(keep.sum()) * sfa.shape[1] * 4
        assert b.blobs[a_st.blob].nbytes == a_st.held_nbytes
        b.verify()
    assert not announce.dump_path(path, 0).exists()  # removed with the journal


def test_salvage_of_a_call_that_touches_no_row(tmp_path):
    path, (_, _, labels) = _fake_call(tmp_path, empty=True)
    res = salvage_journal(path, tmp_path / "out")
    assert not res.torn
    (bundle,) = res.bundles
    with load_bundle(bundle) as b:
        call = b.calls[0]
        (a2, s2), lab = call.args[0], call.args[1]
        assert torch.equal(lab, labels) and not a2.view(torch.uint8).any() and not s2.any()
        assert call.meta["journal"]["device"]["rows_kept"] == 0
        assert call.storages[0].held_nbytes == 0
        b.verify()


def test_slot_whose_host_copy_is_an_earlier_calls_is_torn(tmp_path):
    # the GPU ran the previous occupant's host copy late, after the host reused the slot
    path, _ = _fake_call(tmp_path, record_seq=-1)
    res = salvage_journal(path, tmp_path / "out")
    assert not res.bundles
    (t,) = res.torn
    assert "earlier call" in t.reason


def test_held_ranges_merge_runs_of_rows_and_columns():
    """Row-major A: one range per run of touched rows; MN-major scales: one per run and column."""
    a, sfa, labels = _contig_operands([5, 0, 2], k=256, seed=3)
    tensors = [a, sfa, labels]
    storages, records = group_storages(tensors)
    plan = gather.make_plan(tensors, records, storages, [0, 1], "labels", 2, 1)
    assert plan is not None
    idx = torch.nonzero(labels >= 0).reshape(-1)
    got = gather.held_ranges(plan, idx, limit=1000)
    assert got is not None
    runs = []  # runs of consecutive touched rows
    for r in idx.tolist():
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    ga, gs = plan.gathers
    assert got[ga.storage] == [
        (ga.src_offset + lo * ga.inner_stride, ga.src_offset + hi * ga.inner_stride)
        for lo, hi in runs
    ]
    want = sorted(
        (gs.src_offset + c * gs.col_stride + lo * 4, gs.src_offset + c * gs.col_stride + hi * 4)
        for lo, hi in runs
        for c in range(gs.cols)
    )
    assert got[gs.storage] == want
    assert gather.held_ranges(plan, idx, limit=len(runs) - 1) is None  # over the limit
    assert gather.held_ranges(plan, idx[:0], limit=10) == {ga.storage: [], gs.storage: []}


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"head_bump": 16 << 20}, "overwritten by later calls"),
        ({"seq_off": 1}, "holds another call"),
        ({"complete": False}, "did not complete"),
    ],
)
def test_salvage_refuses_a_device_slot_that_is_not_this_call(tmp_path, change, reason):
    path, _ = _fake_call(tmp_path, **change)
    (bundle,) = salvage_journal(path, tmp_path / "out").bundles
    with load_bundle(bundle) as b:
        call = b.calls[0]
        assert reason in call.meta["journal"]["device"]["missing"]
        assert {0, 1} <= set(call.meta["journal"]["missing_tensors"])


def test_salvage_of_the_torch_fallback_takes_whole_storages(tmp_path):
    path, (a, sfa, labels) = _fake_call(tmp_path, whole=True)
    (bundle,) = salvage_journal(path, tmp_path / "out").bundles
    with load_bundle(bundle) as b:
        call = b.calls[0]
        (a2, s2), lab = call.args[0], call.args[1]
        assert torch.equal(a2.view(torch.uint8), a.view(torch.uint8))  # every row, padding too
        assert torch.equal(s2, sfa) and torch.equal(lab, labels)
        assert "whole" in call.meta["journal"]["device"]["copied"]


def test_slot_in_flight_at_the_crash_is_completed_from_the_twin(tmp_path):
    path, (a, _, labels) = _fake_call(tmp_path, host_copied=False)
    res = salvage_journal(path, tmp_path / "out")
    (bundle,) = res.bundles
    assert not res.in_flight
    with load_bundle(bundle) as b:
        call = b.calls[0]
        facts = call.meta["journal"]
        assert "device twin" in facts["note"] and facts["in_flight"]
        assert torch.equal(call.args[1], labels)
        keep = labels >= 0
        assert torch.equal(call.args[0][0].view(torch.uint8)[keep], a.view(torch.uint8)[keep])


def test_slot_whose_kernel_finished_before_its_host_copy_is_finished_from_the_twin(tmp_path):
    # The done marker follows the kernel on the call's stream while the host copy runs on a side
    # stream: a crash between them leaves pre and done written, post not.
    path, (_, _, labels) = _fake_call(tmp_path, host_copied=False, kernel_done=True)
    res = salvage_journal(path, tmp_path / "out")
    (bundle,) = res.bundles
    with load_bundle(bundle) as b:
        facts = b.calls[0].meta["journal"]
        assert "device twin" in facts["note"]
        assert facts["finished"] and not facts["in_flight"]
        assert torch.equal(b.calls[0].args[1], labels)


def test_salvage_without_a_dump_says_why(tmp_path):
    path, _ = _fake_call(tmp_path)
    announce.dump_path(path, 0).unlink()
    (bundle,) = salvage_journal(path, tmp_path / "out").bundles
    with load_bundle(bundle) as b:
        assert "no device-tier dump" in b.calls[0].meta["journal"]["device"]["missing"]


def test_damaged_dumps_are_refused(tmp_path):
    p = tmp_path / "x.cuda0"
    p.write_bytes(b"\0" * 8192)
    with pytest.raises(devring.DeviceTierError):
        devring.read_dump(p)
    assert devring.plan_layout(0, 4, 4096)[0] is None
    assert "does not hold" in devring.plan_layout(1 << 20, 64, 1 << 20)[1]


class _FakeOccupancy:
    """The few cuda-bindings driver calls resident_blocks makes."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16

    def __init__(self, per_sm: int, sms: int, fail: str = "") -> None:
        self.per_sm, self.sms, self.fail, self.asked = per_sm, sms, fail, []

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, threads, smem):
        self.asked.append((fn, threads, smem))
        if self.fail == "raise":
            raise TypeError("an older binding")
        return (1 if self.fail == "occupancy" else 0), self.per_sm

    def cuCtxGetDevice(self):
        return 0, 0

    def cuDeviceGetAttribute(self, attr, dev):
        assert attr == 16
        return 0, self.sms


def test_resident_blocks_is_blocks_per_sm_times_sms(monkeypatch):
    import kdump.cuda.nvrtc

    fake = _FakeOccupancy(3, 132)
    monkeypatch.setattr(kdump.cuda.nvrtc, "driver", lambda: fake)
    assert gather.resident_blocks("fn", 32768) == 396
    assert fake.asked == [("fn", gather.THREADS, 32768)]
    for fail in ("occupancy", "raise"):  # unknown: one block per unit
        monkeypatch.setattr(kdump.cuda.nvrtc, "driver", lambda f=fail: _FakeOccupancy(3, 132, f))
        assert gather.resident_blocks("fn", 32768) == 0
